//! What this rank says of each agreement on failed ranks when the status
//! port is asked: its proposal and the sets it decided. The agreement
//! itself runs in [`crate::fault::agree`]; this ballot is all of it that
//! the status port needs.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use transport::Rank;

use crate::bootstrap::mesh::Addresses;

/// One communicator's agreements, as its board keeps them: the protocol
/// ([`crate::fault::agree`]) writes them, the status port answers from them.
#[derive(Default)]
pub(crate) struct Ballot {
    /// Agreements started (the current one's number).
    pub(crate) current: u32,
    pub(crate) proposal: Vec<Rank>,
    /// The current agreement's payload (a shrink's new addresses).
    pub(crate) payload: Option<Addresses>,
    /// By agreement number - 1: the answer "decided", serialized once and
    /// shared by every reply (a decision carries every member's payload,
    /// and every member asks).
    decided: Vec<Option<Arc<[u8]>>>,
}

/// What an agreement decided: the failed ranks and every member's
/// payload, by rank (so a rank that adopts it need ask nobody else).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub failed: Vec<Rank>,
    pub payloads: Vec<Option<Addresses>>,
}

/// What a rank says of agreement number k.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Answer {
    /// Alive, and not yet in it.
    NotYet,
    Proposing {
        failed: Vec<Rank>,
        payload: Option<Addresses>,
    },
    Decided(Decision),
    /// The rank no longer has the communicator.
    Left,
}

impl Ballot {
    /// Records that agreement `k` (from 1) decided `d`.
    pub(crate) fn decide(&mut self, k: u32, d: Decision) {
        let at = (k as usize).saturating_sub(1);
        if self.decided.len() <= at {
            self.decided.resize(at + 1, None);
        }
        let text = serde_json::to_vec(&Answer::Decided(d)).expect("an answer serializes");
        self.decided[at] = Some(text.into());
    }

    /// What this rank says of agreement `k`, as it goes on the wire.
    pub fn answer(&self, k: u32) -> Arc<[u8]> {
        let decided = (k as usize)
            .checked_sub(1)
            .and_then(|i| self.decided.get(i));
        if let Some(Some(d)) = decided {
            return d.clone();
        }
        let answer = match k == self.current && k > 0 {
            true => Answer::Proposing {
                failed: self.proposal.clone(),
                payload: self.payload.clone(),
            },
            false => Answer::NotYet,
        };
        serde_json::to_vec(&answer)
            .expect("an answer serializes")
            .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_follow_the_agreement_number() {
        let mut s = Ballot::default();
        let read = |s: &Ballot, k| serde_json::from_slice::<Answer>(&s.answer(k)).unwrap();
        assert_eq!(read(&s, 1), Answer::NotYet);
        s.current = 1;
        s.proposal = vec![2];
        assert_eq!(
            read(&s, 1),
            Answer::Proposing {
                failed: vec![2],
                payload: None
            }
        );
        let d = Decision {
            failed: vec![2, 3],
            payloads: vec![None; 4],
        };
        s.decide(1, d.clone());
        s.current = 2;
        s.proposal = vec![];
        assert_eq!(read(&s, 1), Answer::Decided(d));
        assert_eq!(read(&s, 3), Answer::NotYet);
    }
}
