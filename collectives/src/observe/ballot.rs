//! What this rank says of each agreement on failed ranks when the status
//! port is asked: its proposal and the sets it decided. The agreement
//! itself runs in [`crate::fault::agree`]; this ballot is all of it that
//! the status port needs.

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
    /// By agreement number - 1: the decided set and the payload.
    pub(crate) decided: Vec<Vec<Rank>>,
    pub(crate) payloads: Vec<Option<Addresses>>,
    /// By agreement number - 1: every member's payload, as the decider
    /// knew them (so a rank that adopts a decision needs ask nobody else).
    pub(crate) all_payloads: Vec<Vec<Option<Addresses>>>,
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
    Decided {
        failed: Vec<Rank>,
        payload: Option<Addresses>,
        /// Every member's payload, by rank (`None`: failed, or none).
        #[serde(default)]
        all: Vec<Option<Addresses>>,
    },
    /// The rank no longer has the communicator.
    Left,
}

impl Ballot {
    pub fn answer(&self, k: u32) -> Answer {
        let at = k as usize;
        if at >= 1 && at <= self.decided.len() {
            return Answer::Decided {
                failed: self.decided[at - 1].clone(),
                payload: self.payloads[at - 1].clone(),
                all: (self.all_payloads.get(at - 1).cloned()).unwrap_or_default(),
            };
        }
        match k == self.current && k > 0 {
            true => Answer::Proposing {
                failed: self.proposal.clone(),
                payload: self.payloads.get(at - 1).cloned().flatten(),
            },
            false => Answer::NotYet,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_follow_the_agreement_number() {
        let mut s = Ballot::default();
        assert_eq!(s.answer(1), Answer::NotYet);
        s.current = 1;
        s.proposal = vec![2];
        s.payloads = vec![None];
        assert_eq!(
            s.answer(1),
            Answer::Proposing {
                failed: vec![2],
                payload: None
            }
        );
        s.decided = vec![vec![2, 3]];
        s.current = 2;
        s.proposal = vec![];
        s.payloads.push(None);
        assert_eq!(
            s.answer(1),
            Answer::Decided {
                failed: vec![2, 3],
                payload: None,
                all: vec![],
            }
        );
        assert_eq!(s.answer(3), Answer::NotYet);
    }
}
