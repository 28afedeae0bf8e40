//! Agreeing on which ranks failed, the way ULFM's `MPIX_Comm_agree` does for
//! MPI: every survivor ends with the same set, even when several ranks die
//! at once or one dies during the agreement, and no fixed coordinator is
//! needed (the one of the moment could be the rank that died).
//!
//! It runs over the status channel ([`crate::observe::status`]), not the
//! communicator's connections, which a failure has aborted: each process
//! answers from its own thread, a dead process refuses the connection, a
//! stopped one does not answer within 2 s, and one no connection gets
//! through to (a host down or cut off, or a port a flood keeps full) counts
//! as failed only once that lasted [`UNREACHABLE_FOR`]: a stranger cannot
//! have a live rank voted out by filling its port's queue for a moment.
//! Each rank publishes a proposal (the ranks it believes failed) and, in
//! rounds, asks for theirs: the lowest rank outside its proposal (the
//! coordinator) asks every rank outside it; every other rank asks only its
//! parent in a tree of the ranks outside its proposal, rooted at the
//! coordinator, `FANOUT` children each.
//! A round costs O(n) questions, not O(n^2); no status port is asked by
//! more than the coordinator and `FANOUT` children; a proposal or decision
//! reaches every rank in O(log n) rounds. What an answer does:
//!
//! * refused, or no answer to a question its port took (or the
//!   communicator is gone): that rank failed;
//! * no connection got through: wait for it, up to [`UNREACHABLE_FOR`]
//!   since it was first out of reach, then it failed;
//! * a proposal: add it to ours (proposals only grow);
//! * "not yet": that rank is alive and has not joined (or not even made
//!   the communicator yet); wait for it;
//! * a decision: adopt it.
//!
//! The coordinator decides its proposal P once every rank outside P
//! answered with exactly P, and keeps answering "decided P" with every
//! member's payload; the others adopt that. Two ranks cannot decide
//! different sets: deciding P needs every other rank outside P to have
//! proposed P (a rank that decided answers "decided", which is not a
//! proposal), and a proposal that grew past P never goes back. A rank
//! answers "decided" only with what it decided or adopted, so every
//! decision comes from a coordinator, whichever parent passed it on. If the
//! coordinator (or a parent) dies, those that ask it find out, count it
//! failed, and ask their new parent; the next lowest rank takes over,
//! asking everyone (and adopting a decision any of them holds).
//! A rank that dies after others decided is simply a member of the result
//! that will fail its next call (then agree again), as with ULFM.
//!
//! Each agreement on a communicator has a number (every survivor makes the
//! same sequence of agreement calls, as with collectives) and may carry a
//! payload, the addresses a shrink's new listeners publish.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use transport::Rank;

use crate::bootstrap::mesh::Addresses;
use crate::observe::ballot::{Answer, Decision};
use crate::observe::status::{self, Board, Silence};

/// What an agreement gives: the failed ranks, and each rank's payload.
pub(crate) struct Outcome {
    pub failed: Vec<Rank>,
    pub payloads: Vec<Option<Addresses>>,
}

/// Who takes part: this rank, every rank's status port (`None`: it
/// published none), the communicator's session token and this rank's board.
pub(crate) struct Members<'a> {
    pub me: Rank,
    pub addresses: &'a [Option<SocketAddr>],
    pub session: u128,
    pub board: &'a Board,
}

/// Agreement number `k` among `members`, starting from the ranks this rank
/// knows failed. `Err` says why it could not end (a rank that never joined
/// by `deadline`, or the others deciding that this rank failed).
pub(crate) fn agree(
    members: &Members<'_>,
    k: u32,
    known: BTreeSet<Rank>,
    payload: Option<Addresses>,
    deadline: Instant,
) -> Result<Outcome, String> {
    let Members {
        me,
        addresses,
        session,
        board,
    } = *members;
    let n = addresses.len();
    let mut failed: BTreeSet<Rank> = known.into_iter().filter(|r| *r != me && *r < n).collect();
    let mut payloads = vec![None; n];
    payloads[me] = payload.clone();
    board.agreement(|s| {
        s.current = k;
        s.proposal = failed.iter().copied().collect();
        s.payload = payload;
    });
    let mut pause = FIRST_PAUSE;
    // Since when each rank out of reach has been (see `UNREACHABLE_FOR`).
    let mut out_of_reach: HashMap<Rank, Instant> = HashMap::new();
    let decided = loop {
        let alive: Vec<Rank> = (0..n).filter(|r| !failed.contains(r)).collect();
        let leading = alive.first() == Some(&me);
        let up = [parent(&alive, me)];
        let asked: Vec<(Rank, Option<SocketAddr>)> = (if leading { &alive[1..] } else { &up })
            .iter()
            .map(|&r| (r, addresses[r]))
            .collect();
        let before = failed.clone();
        let (mut settled, mut adopted) = (true, None);
        let (mut not_yet, mut unreached) = (Vec::new(), Vec::new());
        for (r, answer) in ask_all(&asked, session, k, n) {
            tracing::debug!(
                rank = me,
                agreement = k,
                peer = r,
                ?answer,
                "agreement answer"
            );
            if !matches!(answer, Err(Silence::Unreachable)) {
                out_of_reach.remove(&r);
            }
            match answer {
                Err(Silence::Unreachable) => {
                    let since = *out_of_reach.entry(r).or_insert_with(Instant::now);
                    match since.elapsed() >= UNREACHABLE_FOR {
                        true => drop(failed.insert(r)),
                        false => {
                            settled = false;
                            unreached.push(r);
                        }
                    }
                }
                Err(_) | Ok(Answer::Left) => {
                    failed.insert(r);
                }
                Ok(Answer::NotYet) => {
                    settled = false;
                    not_yet.push(r);
                }
                Ok(Answer::Proposing {
                    failed: theirs,
                    payload,
                }) => {
                    payloads[r] = payload;
                    settled &= theirs.iter().copied().eq(before.iter().copied());
                    failed.extend(theirs.into_iter().filter(|r| *r < n));
                }
                Ok(Answer::Decided(d)) => {
                    // The decider's payloads; ours stays ours.
                    for (q, p) in d.payloads.into_iter().enumerate().take(n) {
                        if q != me {
                            payloads[q] = p;
                        }
                    }
                    adopted = Some(d.failed);
                }
            }
        }
        if let Some(d) = adopted {
            break d.into_iter().collect::<BTreeSet<Rank>>();
        }
        if failed.contains(&me) {
            return Err(format!(
                "the other ranks count this rank among the failed ({}): it answered too late",
                status::list(&failed.iter().copied().collect::<Vec<_>>())
            ));
        }
        board.agreement(|s| s.proposal = failed.iter().copied().collect());
        if leading && settled && failed == before {
            break failed;
        }
        if Instant::now() > deadline {
            let why = match (not_yet.is_empty(), leading) {
                _ if !unreached.is_empty() => format!(
                    "rank(s) {} could not be reached (host down or cut off, or its status port flooded)",
                    status::list(&unreached)
                ),
                (false, _) => format!(
                    "rank(s) {} have not joined it (every survivor must make the same agreement calls)",
                    status::list(&not_yet)
                ),
                (true, false) => format!(
                    "coordinator rank {} has not decided (asked through rank {})",
                    alive[0], up[0]
                ),
                (true, true) => "the survivors' proposals never settled".into(),
            };
            return Err(format!("no agreement within the timeout: {why}"));
        }
        // Rounds start 1 ms apart and back off (to `MOST_PAUSE`): a round of the
        // coordinator is a connection to every rank, and a flood of them
        // (a slow host, many ranks waiting for a late one) would delay the
        // answers themselves.
        std::thread::sleep(pause);
        pause = (pause * 2).min(MOST_PAUSE);
    };
    if decided.contains(&me) {
        return Err("the other ranks decided that this rank failed: it answered too late".into());
    }
    let failed: Vec<Rank> = decided.iter().copied().collect();
    // Every survivor's payload: the coordinator heard each (a proposal
    // carries it), and passes them on with its decision.
    let decision = Decision {
        failed: failed.clone(),
        payloads: (0..n)
            .map(|r| {
                (!decided.contains(&r))
                    .then(|| payloads[r].clone())
                    .flatten()
            })
            .collect(),
    };
    board.agreement(|s| s.decide(k, decision));
    Ok(Outcome { failed, payloads })
}

/// The first pause between rounds, doubled each round up to [`MOST_PAUSE`].
pub const FIRST_PAUSE: Duration = Duration::from_millis(1);
/// The longest pause between rounds.
pub const MOST_PAUSE: Duration = Duration::from_millis(50);
/// How long a rank no connection gets through to may stay out of reach
/// before it counts as failed. A host that died is noticed this late (a
/// process that died, or stopped, within 2 s); in exchange, to have a live
/// rank voted out a flood must keep its port's queue full through every
/// fresh attempt of 10 s (about 30; `status::ask`), which is cutting the
/// host off the network.
pub const UNREACHABLE_FOR: Duration = Duration::from_secs(10);
/// Children per rank in the tree the non-coordinators ask along.
pub const FANOUT: usize = 32;

/// Whom `me` asks in a round when it does not coordinate: its parent in the
/// `FANOUT`-ary tree over `alive` (the ranks outside its proposal, in
/// order, `me` among them), whose root is the coordinator. A parent always
/// has a lower rank, so questions never go round in a circle.
pub fn parent(alive: &[Rank], me: Rank) -> Rank {
    let at = alive
        .binary_search(&me)
        .expect("a rank is outside its own proposal");
    alive[at.saturating_sub(1) / FANOUT]
}

/// Every rank's answer about agreement `k` among `n`, or why it gave none
/// (an answer that does not parse counts as none from a live process).
fn ask_all(
    ranks: &[(Rank, Option<SocketAddr>)],
    session: u128,
    k: u32,
    n: usize,
) -> Vec<(Rank, Result<Answer, Silence>)> {
    let question = status::question(status::AGREEMENT, session, k);
    let parse = |b: Vec<u8>| serde_json::from_slice(&b).map_err(|_| Silence::Mute);
    status::ask_each(ranks, &question, status::agreement_answer_max(n))
        .into_iter()
        .map(|(r, bytes)| (r, bytes.and_then(parse)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_reaches_the_coordinator_along_lower_ranks() {
        let alive: Vec<Rank> = (0..1000).filter(|r| r % 7 != 3).collect();
        let mut askers = vec![0usize; 1000];
        for &r in &alive[1..] {
            let (mut at, mut hops) = (r, 0);
            askers[parent(&alive, r)] += 1;
            while at != alive[0] {
                let p = parent(&alive, at);
                assert!(p < at);
                (at, hops) = (p, hops + 1);
            }
            assert!(hops <= 4, "rank {r}: {hops} hops");
        }
        assert!(askers.iter().all(|a| *a <= FANOUT));
    }

    /// Rank 0 coordinates an agreement with a rank 1 whose port is out of
    /// reach (its queue full) for `for_` and then answers as a live rank
    /// proposing nothing (`None`: never). Returns what rank 0 agreed and
    /// when.
    fn agree_with_a_rank_out_of_reach(for_: Option<Duration>) -> (Vec<Rank>, Duration) {
        use crate::observe::status::tests::{answer_after, full_queue};
        let mut port = Some(full_queue());
        let addresses = [None, Some(port.as_ref().unwrap().0.local_addr().unwrap())];
        let proposal = Answer::Proposing {
            failed: vec![],
            payload: None,
        };
        let reply = serde_json::to_vec(&proposal).unwrap();
        let question_len = status::question(status::AGREEMENT, 0, 0).len();
        // Never: the port stays open, its queue full, until the end.
        let live = for_.map(|d| answer_after(port.take().unwrap(), d, question_len, reply));
        let board = Board::default();
        let members = Members {
            me: 0,
            addresses: &addresses,
            session: 0xa9ee,
            board: &board,
        };
        let t = Instant::now();
        let deadline = t + Duration::from_secs(30);
        let outcome = agree(&members, 1, BTreeSet::new(), None, deadline).unwrap();
        let took = t.elapsed();
        if let Some(h) = live {
            h.join().unwrap();
        }
        drop(port);
        (outcome.failed, took)
    }

    #[test]
    fn a_live_rank_out_of_reach_for_a_while_is_not_voted_out() {
        let (failed, took) = agree_with_a_rank_out_of_reach(Some(Duration::from_secs(4)));
        assert_eq!(failed, Vec::<Rank>::new());
        assert!(took >= Duration::from_secs(4), "{took:?}");
    }

    #[test]
    fn a_rank_out_of_reach_for_too_long_counts_as_failed() {
        let (failed, took) = agree_with_a_rank_out_of_reach(None);
        assert_eq!(failed, vec![1]);
        assert!(took >= UNREACHABLE_FOR, "{took:?}");
    }
}
