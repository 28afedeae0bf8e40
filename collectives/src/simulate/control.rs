//! Predicting the control plane at scale: how long a job takes to form
//! (the rendezvous and its relay tree) and to agree on a failed rank (the
//! agreement and a shrink), in rounds, messages and time. The plans are
//! the library's own: the relay tree of [`crate::bootstrap::relay`], the
//! agreement's tree of askers (`fault::agree::parent`) and its
//! pauses, the status port's batches, and a real table entry's size.
//!
//! A control message is a TCP connection carrying JSON. What it costs:
//!
//! ```text
//! connect + question + answer   3 L + CONTROL_CPU            (both ends' syscalls)
//! a message of m bytes          + m / B on each NIC, + m / PARSE to read it,
//!                               + m / SERIALIZE to write it
//! a question on its own thread  + THREAD_CPU on the asker
//! ```
//!
//! `L` and `B` are the cluster's link latency and bandwidth between hosts
//! (every rank its own host: a host's ranks share nothing here). The CPU
//! figures were measured on a 2-vCPU AMD EPYC VM (loopback, release build,
//! busy with a test run at the same time): a 364-byte table entry, JSON
//! written at 916 MB/s and read at 142 MB/s, a question's round trip 80 us,
//! a thread spawned and joined 30 us. Left out: a rank's start (its
//! process, its listeners), and the first call's connections (the
//! collective simulation's schedules say whom each rank needs).

use std::collections::BTreeMap;

use crate::bootstrap::relay;
use crate::bootstrap::rendezvous::{to_hex, PeerInfo};
use crate::fault::agree;
use crate::observe::status;

use super::Cluster;

const CONTROL_CPU: f64 = 80e-6;
const THREAD_CPU: f64 = 30e-6;
const SERIALIZE: f64 = 900e6;
const PARSE: f64 = 140e6;
/// A rendezvous reply without the table: the session, a parent, `FANOUT`
/// children's addresses.
const SMALL_REPLY: f64 = 100.0 + 25.0 * relay::FANOUT as f64;
/// A join is an entry plus the job, the size and the relay address.
const JOIN_EXTRA: f64 = 120.0;

/// One phase of a prediction.
#[derive(Clone, Debug)]
pub struct Phase {
    pub name: &'static str,
    /// When it ends, from the start, for the slowest rank.
    pub seconds: f64,
    /// Messages of the phase, all ranks together.
    pub messages: u64,
    /// The most bytes one rank sends in it.
    pub busiest_bytes: f64,
}

/// A control-plane prediction: its phases in order, and the rounds
/// (hand-overs one after the other) of the whole.
#[derive(Clone, Debug)]
pub struct ControlPrediction {
    pub ranks: usize,
    pub rounds: usize,
    pub phases: Vec<Phase>,
}

impl ControlPrediction {
    pub fn seconds(&self) -> f64 {
        self.phases.last().map_or(0.0, |p| p.seconds)
    }
    pub fn messages(&self) -> u64 {
        self.phases.iter().map(|p| p.messages).sum()
    }
}

/// The bytes of one rank's entry in the rendezvous's table, as JSON: a
/// real entry with TCP, verbs and status addresses.
pub fn entry_bytes() -> f64 {
    let mut addresses = BTreeMap::new();
    addresses.insert("tcp".to_string(), to_hex(&[0; 26]));
    addresses.insert("verbs".to_string(), to_hex(&[0; 40]));
    addresses.insert("status".to_string(), to_hex(b"10.1.2.3:45678"));
    let entry = PeerInfo {
        rank: 12345,
        hostname: "node-01234".into(),
        host_id: format!("{:032x}", u128::MAX),
        pid: 123456,
        cores: 96,
        addresses,
        settings: crate::Config::default().shared_settings(),
    };
    serde_json::to_vec(&entry)
        .expect("an entry serializes")
        .len() as f64
        + 1.0
}

/// Forming a job of `cluster.ranks`: every rank joins the rendezvous, which
/// sends the table to the relay tree's first ranks and a small reply to the
/// rest; each rank passes the table on to its children.
pub fn init(cluster: &Cluster) -> ControlPrediction {
    let n = cluster.ranks;
    let (l, b) = (cluster.link.latency, cluster.network_bandwidth());
    let entry = entry_bytes();
    let table = n as f64 * entry + 64.0;
    let join = entry + JOIN_EXTRA;
    // The hub reads every join: its NIC or its CPU, whichever is slower.
    let joined = 3.0 * l + n as f64 * (join / b).max(CONTROL_CPU + join / PARSE);
    // It answers in rank order: the table to the tree's first ranks.
    let mut replied = vec![0.0; n];
    let mut at = joined;
    for (r, t) in replied.iter_mut().enumerate() {
        at += match relay::parent(r) {
            None => table / SERIALIZE + table / b,
            Some(_) => CONTROL_CPU / 2.0 + SMALL_REPLY / b,
        };
        *t = at + l;
    }
    // Down the tree: a parent writes the table once and sends it to all its
    // children at once, sharing its NIC; a child reads it once it has its
    // own reply.
    let mut has = vec![0.0; n];
    let mut done = vec![0.0; n];
    for r in 0..n {
        has[r] = match relay::parent(r) {
            None => replied[r] + table / PARSE,
            // The parent's children all have it when it is done sending.
            Some(p) => replied[r].max(done[p]) + table / PARSE,
        };
        done[r] = match fanout(r, n) > 0.0 {
            true => has[r] + table / SERIALIZE + 3.0 * l + fanout(r, n) * table / b,
            false => has[r],
        };
    }
    let hub_out =
        relay::FANOUT.min(n) as f64 * table + n.saturating_sub(relay::FANOUT) as f64 * SMALL_REPLY;
    ControlPrediction {
        ranks: n,
        // The joins, then the hand-overs down to the last rank.
        rounds: 1 + relay::hops(n),
        phases: vec![
            Phase {
                name: "every rank joins the rendezvous",
                seconds: joined,
                messages: n as u64,
                busiest_bytes: join,
            },
            Phase {
                name: "the rendezvous answers",
                seconds: replied.iter().copied().fold(0.0, f64::max),
                messages: n as u64,
                busiest_bytes: hub_out,
            },
            Phase {
                name: "the table down the relay tree",
                seconds: done.iter().copied().fold(0.0, f64::max),
                messages: n.saturating_sub(relay::FANOUT) as u64,
                busiest_bytes: match n > relay::FANOUT {
                    true => relay::FANOUT as f64 * table,
                    false => 0.0,
                },
            },
        ],
    }
}

fn fanout(rank: usize, n: usize) -> f64 {
    relay::children(rank, n).len() as f64
}

/// What `collbench simulate` can predict of the control plane, by name.
pub const KINDS: [&str; 3] = ["init", "agree", "shrink"];

/// The prediction named `kind` (one of [`KINDS`]) on `cluster`.
pub fn predict(kind: &str, cluster: &Cluster) -> Option<ControlPrediction> {
    match kind {
        "init" => Some(init(cluster)),
        "agree" => Some(agreement(cluster, 0.0)),
        // A shrink's agreement carries each member's new addresses: an entry.
        "shrink" => Some(agreement(cluster, entry_bytes())),
        _ => None,
    }
}

/// Agreeing that one rank failed, every survivor having noticed it when it
/// starts. `payload`: bytes each member adds (a shrink's new addresses, 0
/// for a plain agreement); a decision carries all of them.
///
/// The coordinator asks every survivor in batches of
/// `status::AT_ONCE` threads and decides after one round (every answer
/// is its own proposal); the others ask their parent in the agreement's
/// tree, pausing 1 ms, 2 ms, ... up to `agree::MOST_PAUSE` between
/// questions, and adopt the decision once their parent holds it.
pub fn agreement(cluster: &Cluster, payload: f64) -> ControlPrediction {
    let n = cluster.ranks;
    let (l, b) = (cluster.link.latency, cluster.network_bandwidth());
    let dead = n - 1;
    let alive: Vec<usize> = (0..n).filter(|r| *r != dead).collect();
    let proposal = 40.0 + payload;
    // The coordinator's round: batches one after the other, each a thread
    // per question, its answers through its NIC and its parser.
    let asked = alive.len().saturating_sub(1);
    let batch = |k: usize| {
        k as f64 * (THREAD_CPU + proposal / PARSE) + 3.0 * l + CONTROL_CPU + k as f64 * proposal / b
    };
    let full = asked / status::AT_ONCE;
    let decided = full as f64 * batch(status::AT_ONCE) + batch(asked % status::AT_ONCE);
    // The decision, written once, read by every child from its parent.
    let decision = 40.0 + n as f64 * (payload + 8.0);
    let answer = 3.0 * l + CONTROL_CPU + decision / b + decision / PARSE;
    // Until then a parent answers with its proposal.
    let waiting = 3.0 * l + CONTROL_CPU + proposal / b + proposal / PARSE;
    let mut learned = BTreeMap::new();
    learned.insert(
        alive.first().copied().unwrap_or(0),
        decided + decision / SERIALIZE,
    );
    let (mut polls, mut depth) = (0u64, vec![0usize; n]);
    for &r in alive.iter().skip(1) {
        let parent = agree::parent(&alive, r);
        depth[r] = depth[parent] + 1;
        // The parent answers its children one after another.
        let ready = learned[&parent] + agree::FANOUT as f64 * decision / b;
        let (at, asked) = first_question_after(ready, waiting);
        polls += asked;
        learned.insert(r, at + answer);
    }
    let last = learned.values().copied().fold(0.0, f64::max);
    ControlPrediction {
        ranks: n,
        rounds: 1 + depth.iter().copied().max().unwrap_or(0),
        phases: vec![
            Phase {
                name: "the coordinator asks every survivor",
                seconds: decided,
                messages: asked as u64,
                busiest_bytes: asked as f64 * 24.0,
            },
            Phase {
                name: "the decision down the tree of askers",
                seconds: last,
                messages: polls,
                busiest_bytes: agree::FANOUT as f64 * decision,
            },
        ],
    }
}

/// A non-coordinator's questions, each taking `each`, with the agreement's
/// pauses between them: when the first that starts at or after `ready`
/// starts, and how many it asked by then.
fn first_question_after(ready: f64, each: f64) -> (f64, u64) {
    let most = agree::MOST_PAUSE.as_secs_f64();
    let (mut at, mut pause, mut asked) = (0.0, agree::FIRST_PAUSE.as_secs_f64(), 1u64);
    while at < ready {
        at += each + pause;
        pause = (pause * 2.0).min(most);
        asked += 1;
    }
    (at, asked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forming_grows_with_the_table_not_the_square() {
        let at = |n| init(&Cluster::roce(n, 8));
        let (small, large) = (at(1000), at(100_000));
        assert_eq!((small.rounds, large.rounds), (1 + 4, 1 + 6));
        // 100x the ranks: the table is 100x larger and read by each rank,
        // so about 100x the time, not 10,000x.
        let ratio = large.seconds() / small.seconds();
        assert!((20.0..200.0).contains(&ratio), "{ratio}");
        assert_eq!(large.messages(), 3 * 100_000 - relay::FANOUT as u64);
    }

    #[test]
    fn an_agreement_asks_o_n_questions() {
        let a = agreement(&Cluster::roce(10_000, 8), 0.0);
        assert_eq!(a.phases[0].messages, 9_998);
        // Each of the others asks every 50 ms at most while the coordinator
        // asks everyone (about 0.3 s here), then once more: O(n) in all.
        assert!(a.messages() < 20 * 10_000, "{}", a.messages());
        assert!(a.rounds <= 5);
        let shrink = agreement(&Cluster::roce(10_000, 8), 400.0);
        assert!(shrink.seconds() > a.seconds());
    }
}
