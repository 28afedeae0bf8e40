//! A flag call in flight, and its kernels: which ranks' parts it reads,
//! which bytes of its output it publishes, and how a peer's part is taken
//! into the output (copied or reduced).

use transport::{Rank, Tag};

use super::segment::Label;
use crate::call::descriptor::Collective;
use crate::call::reduce;
use crate::{DataType, ReduceOp};

/// A flag call in flight.
pub(crate) struct FlagCall {
    /// Its flag number.
    pub(super) k: u64,
    pub(super) tag: Tag,
    pub(super) chain: u32,
    pub(super) collective: Collective,
    /// Its larger buffer, in bytes.
    pub(super) bytes: usize,
    pub(super) root: Rank,
    pub(super) in_place: bool,
    /// The ranks of the communicator.
    pub(super) n: usize,
    /// Our part is in our slot; before, the call waits for every rank to
    /// publish call `k + 1 - SLOTS`.
    pub(super) posted: bool,
    /// Ranks below this one published that call (before posting) or were
    /// taken into the output (after).
    pub(super) next: Rank,
    /// Before posting: the ranks below `next`, and we, published every
    /// call up to this one.
    pub(super) reach: u64,
}

impl FlagCall {
    /// The rank whose flag the call waits on.
    pub fn peer(&self) -> Rank {
        self.next
    }

    /// Where the call is: it moved when this changed.
    pub fn mark(&self) -> (bool, Rank) {
        (self.posted, self.next)
    }

    /// Whether rank `me` reads rank `r`'s part: of a broadcast only the
    /// root's, of a reduce only on the root.
    pub(super) fn reads(&self, me: Rank, r: Rank) -> bool {
        match self.collective {
            Collective::Broadcast => r == self.root,
            Collective::Reduce => me == self.root,
            _ => true,
        }
    }

    /// Whether rank `me` reads every rank's part (and so sees every rank
    /// publish the call).
    pub(super) fn reads_all(&self, me: Rank) -> bool {
        (0..self.n).all(|r| self.reads(me, r))
    }

    /// How many bytes rank `r` publishes: the tag fixes every rank's.
    pub(super) fn part_len(&self, r: Rank) -> usize {
        match self.collective {
            Collective::AllGather => self.bytes / self.n,
            Collective::Broadcast if r == self.root => self.bytes,
            Collective::Broadcast | Collective::Barrier => 0,
            _ => self.bytes,
        }
    }

    /// What rank `me` publishes: its input, its block of an in-place
    /// AllGather, nothing off a broadcast's root.
    pub(super) fn own_part<'a>(
        &self,
        me: Rank,
        input: Option<&'a [u8]>,
        output: &'a [u8],
    ) -> &'a [u8] {
        let len = self.part_len(me);
        match (self.collective, input) {
            (Collective::AllGather, None) => &output[me * len..][..len],
            (_, input) => &input.unwrap_or(output)[..len],
        }
    }

    /// Whether a rank's block to itself stays out of its slot, which no
    /// peer reads, and goes from its input to its output directly
    /// (`keep_own_block`): an AllToAll's (2-rank AllToAll of 4 KiB 0.37 ->
    /// 0.20 us a call, of 8 and 16 KiB 0.89x the time). Not a
    /// ReduceScatter's: in place, its result overwrites that block before
    /// the block is added.
    pub(super) fn keeps_own_block(&self) -> bool {
        self.collective == Collective::AllToAll
    }

    /// The ranges of rank `me`'s part (at, len) it copies into its slot:
    /// all of it, or all but its own block (`keeps_own_block`).
    pub(super) fn published_ranges(&self, me: Rank) -> [(usize, usize); 2] {
        let len = self.part_len(me);
        match self.keeps_own_block() {
            true => {
                let block = self.bytes / self.n;
                [(0, me * block), ((me + 1) * block, len - (me + 1) * block)]
            }
            false => [(0, len), (len, 0)],
        }
    }

    /// Rank `me`'s block to itself, straight from its input (in place it
    /// is there already): see `keeps_own_block`.
    pub(super) fn keep_own_block(&self, me: Rank, input: Option<&[u8]>, output: &mut [u8]) {
        let block = self.bytes / self.n;
        if let Some(input) = input {
            output[me * block..][..block].copy_from_slice(&input[me * block..][..block]);
        }
    }

    /// Takes rank `r`'s part, `data`, into `output` (ours, `me`'s).
    pub(super) fn take(
        &self,
        me: Rank,
        r: Rank,
        data: &[u8],
        output: &mut [u8],
        dt: DataType,
        op: ReduceOp,
    ) {
        let block = self.bytes / self.n;
        let combine = |dst: &mut [u8], src: &[u8]| match r {
            0 => dst.copy_from_slice(src),
            _ => reduce::reduce_into(dt, op, dst, src),
        };
        match self.collective {
            Collective::AllReduce => combine(output, data),
            Collective::Reduce if me == self.root => combine(output, data),
            Collective::ReduceScatter => {
                let src = &data[me * block..][..block];
                combine(self.reduced(me, output).expect("reduces"), src)
            }
            Collective::AllGather => output[r * block..][..block].copy_from_slice(data),
            Collective::AllToAll => {
                output[r * block..][..block].copy_from_slice(&data[me * block..][..block])
            }
            Collective::Broadcast if r == self.root => output.copy_from_slice(data),
            _ => {}
        }
    }

    /// Where `me`'s reduction result lies in `output`, if it has one.
    pub(super) fn reduced<'a>(&self, me: Rank, output: &'a mut [u8]) -> Option<&'a mut [u8]> {
        let block = self.bytes / self.n;
        match self.collective {
            Collective::AllReduce => Some(output),
            Collective::Reduce if me == self.root => Some(output),
            Collective::ReduceScatter if self.in_place => Some(&mut output[me * block..][..block]),
            Collective::ReduceScatter => Some(output),
            _ => None,
        }
    }

    /// What the call waits on, for the status board: the flag of the rank
    /// it reads next.
    pub fn waiting(&self) -> crate::observe::waiting::Waiting {
        crate::observe::waiting::Waiting {
            peer: self.next,
            send: false,
            index: 1,
            of: 1,
            bytes: self.bytes,
        }
    }

    /// Rank `peer` labelled `got` what we know as `expected` (this call's
    /// tag, or the one it waits for).
    pub(super) fn mismatch_with(&self, expected: Tag, peer: Rank, got: Label) -> transport::Error {
        transport::Error::Mismatch {
            peer,
            expected_tag: expected,
            expected_len: self.part_len(peer),
            got_tag: got.tag,
            got_len: got.len,
        }
    }
}
