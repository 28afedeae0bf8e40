//! The executor's effects on the real world: transfers posted on transport
//! connections, reductions and copies in the caller's memory and in the
//! registered staging slots.

use std::time::Duration;

use transport::{Connection, MemRegion, Rank, Request, Tag};

use crate::algo::schedule::{Action, Buf, Kind, Schedule, Span, Step};
use crate::call::reduce;
use crate::exec::executor::{Effects, Execution, Source};
use crate::sys::stream_copy;
use crate::{Collective, DataType, HugeBuffer, ReduceOp};

/// Sends in flight per peer (receives are bounded by the pipeline depth).
pub(crate) const SEND_WINDOW: usize = 16;

/// Reductions of [`CACHED_STAGING_FROM`] bytes or more over shared memory
/// stage one chunk of at most this at a time, in one slot: each chunk then
/// lands where the one before was reduced, lines still in our L2. With the
/// pipeline's four 1 MiB slots taken in turn, a slot comes back after 4 MiB
/// of slots and as much again of the buffers streamed past it, and each
/// landing fetched its lines anew. Two threads modelling the 2-rank
/// AllReduce of 16 MiB in place (`ci/allreduce_floor.c`) took 1370 us
/// reading 256 KiB pieces into one 256 KiB buffer, 1513-1619 into a 1 MiB
/// one (its `cma-slot` way). Ours, paired against four 1 MiB slots (Intel
/// Xeon VM, `python3 ci/ab.py allreduce N 16M 6 OLD NEW [--ip]`):
/// AllReduce of 16 MiB in place 0.86x the time (2 ranks), 0.80x (4), 0.90x
/// (8); out of place 0.99x (2), 0.89x (4), 0.95x (8); 4 MiB on 4 ranks
/// 0.87x, ReduceScatter of 16 MiB on 8 ranks 0.79x (4 rounds); 256 MiB and
/// Reduce 1.00-1.02x. One 1 MiB slot alone: 0.92-0.99x; 256 KiB chunks: as
/// 512 KiB, but 1.02-1.03x at 2 ranks out of place.
pub(crate) const CACHED_CHUNK: usize = 512 << 10;
/// Below this a call's staging fits the cache anyway, and one slot held up
/// a tree's two children (8-rank AllReduce of 256 KiB: 1.09x the time).
/// Over TCP, whose chunks are copied out of a socket rather than read from
/// the sender's memory in pieces, it took 1.13x (2 ranks, 16 MiB).
pub(crate) const CACHED_STAGING_FROM: usize = 2 << 20;

/// Whether a call of `collective` on `bytes` stages one chunk of at most
/// [`CACHED_CHUNK`] at a time (see there). Every rank decides alike: all
/// see the same call and whether all messages go through shared memory.
pub(crate) fn stages_in_cache(collective: Collective, bytes: usize, shared_memory: bool) -> bool {
    collective.reduces() && shared_memory && bytes >= CACHED_STAGING_FROM
}

/// A caller buffer as the executor sees it.
pub(crate) struct Region {
    pub ptr: *mut u8,
    pub len: usize,
    pub mr: MemRegion,
}

// SAFETY: a Region names memory its call reserved until it finishes; only
// the thread that owns the communicator dereferences it.
unsafe impl Send for Region {}

/// Chunk-sized receive slots, registered once and reused by every call.
pub(crate) struct Staging {
    storage: HugeBuffer,
    mr: MemRegion,
    pub slot_bytes: usize,
    pub slots: usize,
}

impl Staging {
    pub fn new(
        transports: &[&dyn transport::Transport],
        slot_bytes: usize,
        slots: usize,
    ) -> transport::Result<Self> {
        // Slots of whole cache lines in 8-byte-aligned storage stay aligned
        // for any datatype; on huge pages, a peer writes them fast.
        let slot_bytes = slot_bytes.next_multiple_of(64);
        let len = slot_bytes * slots;
        let mut storage = HugeBuffer::new(len);
        let start = storage.bytes_mut().as_mut_ptr();
        // Peers may write the slots during reductions (`Transfers::post`):
        // the communicator owns them and drops its connections first (field
        // order), as `MemRegion::allow_peer_writes` asks.
        let mr = transport::register_all(transports.iter().copied(), start, len)?;
        Ok(Staging {
            storage,
            mr,
            slot_bytes,
            slots,
        })
    }

    /// `len` bytes of `slot`, from byte `offset` of it.
    fn slot(&self, slot: usize, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= self.slot_bytes);
        &self.storage.bytes()[slot * self.slot_bytes + offset..][..len]
    }
}

/// Everything a schedule's steps act on.
pub(crate) struct Transfers<'a> {
    /// Counts every message posted (and traces it under `COLL_TRACE`).
    pub recorder: &'a mut crate::observe::recorder::Recorder,
    /// Which lane `peers` is (to tell its requests apart in a trace).
    pub lane: usize,
    pub peers: &'a mut [Option<Box<dyn Connection>>],
    /// `None` for in-place calls.
    pub input: Option<&'a Region>,
    pub output: &'a Region,
    /// The call's scratch, when its schedule uses one.
    pub scratch: Option<&'a Region>,
    pub staging: &'a Staging,
    pub dtype: DataType,
    pub op: ReduceOp,
    pub nranks: usize,
    /// The call's tag, for steps without one of their own.
    pub tag: Tag,
}

impl Effects for Transfers<'_> {
    type Token = Request;

    fn post(
        &mut self,
        step: &Step,
        tag: Option<Tag>,
        slot: Option<usize>,
    ) -> transport::Result<Request> {
        let span = step.span();
        let (mr, offset) = match slot {
            Some(slot) => {
                if span.len > self.staging.slot_bytes {
                    return Err(transport::Error::Invalid(format!(
                        "a staged receive of {} bytes exceeds the {}-byte staging slots",
                        span.len, self.staging.slot_bytes
                    )));
                }
                // A peer may write a slot when it may write the call's
                // own buffers: in reductions (see `Communicator::begin`).
                let mr = self.staging.mr.clone();
                let mr = match self.output.mr.peer_writes() {
                    true => mr.allow_peer_writes(),
                    false => mr,
                };
                (mr, slot * self.staging.slot_bytes)
            }
            None => (self.region(span.buf).mr.clone(), span.offset),
        };
        // A reduction reduces what landed while the rest arrives (the
        // executor's `apply_landed`); other receives are only read whole.
        let mr = match step.kind {
            Kind::Staged(Action::Reduce { .. }) => mr.used_as_landed(),
            _ => mr,
        };
        let tag = tag.unwrap_or(self.tag);
        let (peer, send, len) = (step.peer(), step.is_send(), span.len);
        self.recorder.stats.count_message(peer, send, len);
        let conn = connection(self.peers, peer)?;
        // SAFETY: the span or slot stays valid for the whole call (the
        // caller aborts the connections before returning on error), and
        // the schedule's `after` edges keep anyone else off these bytes
        // until the request completes.
        let request = unsafe {
            match step.kind {
                Kind::Send => conn.isend(&mr, offset, len, tag),
                _ => conn.irecv(&mr, offset, len, tag),
            }
        }?;
        if let Some(t) = &mut self.recorder.timeline {
            t.posted(self.lane, peer, request, send, len);
        }
        Ok(request)
    }

    fn is_done(&mut self, peer: Rank, token: Request) -> transport::Result<bool> {
        let done = connection(self.peers, peer)?.is_done(token);
        if let (true, Some(t)) = (done, &mut self.recorder.timeline) {
            t.completed(self.lane, peer, token);
        }
        Ok(done)
    }

    fn landed(&mut self, peer: Rank, token: Request) -> usize {
        let elem = self.dtype.size();
        connection(self.peers, peer).map_or(0, |c| c.landed(token) / elem * elem)
    }

    fn progress(&mut self, involved: &[bool]) -> transport::Result<bool> {
        let mut moved = false;
        for conn in involved_connections(self.peers, involved) {
            moved |= conn.progress()?;
        }
        Ok(moved)
    }

    fn apply(&mut self, action: Action, span: Span, from: Source) {
        let traced = self
            .recorder
            .timeline
            .is_some()
            .then(crate::sys::clock::ticks);
        self.act(action, span, from);
        if let (Some(start), Some(t)) = (traced, &mut self.recorder.timeline) {
            let name = match action {
                Action::Copy => "copy",
                Action::Reduce { .. } => "reduce",
            };
            t.local(name, start, span.len);
        }
    }
    fn copy(&mut self, from: Span, to: Span) {
        stream_copy::copy(self.span_mut(to), self.span(from), self.output.len);
    }
}

impl Transfers<'_> {
    /// `span (action)= from`.
    fn act(&self, action: Action, span: Span, from: Source) {
        let src = match from {
            // The slot holds a completed receive; no request targets it
            // until the executor frees it after this.
            Source::Slot(slot, offset) => Some(self.staging.slot(slot, offset, span.len)),
            Source::Local(from) => Some(self.span(from)),
            // The peer's data landed in the span itself (`lands_in_span`).
            Source::Span => None,
        };
        let input = || {
            self.span(Span {
                buf: Buf::Input,
                ..span
            })
        };
        let dst = self.span_mut(span);
        let (with_input, finalize) = match action {
            Action::Copy => {
                let src = src.expect("a copy has a source");
                return match from {
                    Source::Slot(..) => stream_copy::copy_staged(dst, src, self.output.len),
                    _ => stream_copy::copy(dst, src, self.output.len),
                };
            }
            Action::Reduce {
                with_input,
                finalize,
            } => (with_input, finalize),
        };
        let (dtype, op) = (self.dtype, self.op);
        match (src, with_input) {
            (Some(src), false) => reduce::reduce_into(dtype, op, dst, src),
            (Some(src), true) => reduce::reduce_to(dtype, op, dst, input(), src),
            (None, true) => reduce::reduce_onto(dtype, op, dst, input()),
            (None, false) => unreachable!("only first reductions land in their span"),
        }
        if finalize {
            reduce::finalize(dtype, op, dst, self.nranks);
        }
    }

    fn region(&self, buf: Buf) -> &Region {
        match (buf, self.input) {
            (Buf::Input, Some(input)) => input,
            (Buf::Scratch, _) => self.scratch.expect("the schedule asked for scratch"),
            _ => self.output,
        }
    }

    fn span(&self, span: Span) -> &[u8] {
        let r = self.region(span.buf);
        assert!(span.offset + span.len <= r.len);
        // SAFETY: in bounds (checked); input spans are never written, and the
        // schedule keeps receives off any span while it is read here.
        unsafe { std::slice::from_raw_parts(r.ptr.add(span.offset), span.len) }
    }

    #[allow(clippy::mut_from_ref)] // the buffer is reached through a raw pointer
    fn span_mut(&self, span: Span) -> &mut [u8] {
        assert_ne!(span.buf, Buf::Input, "the input buffer is never written");
        let r = self.region(span.buf);
        assert!(span.offset + span.len <= r.len);
        // SAFETY: in bounds (checked); the schedule's `after` edges guarantee
        // no posted request reads or writes this span while it is written,
        // `with` spans live in the distinct input buffer, and local copies
        // go between distinct buffers (output and scratch).
        unsafe { std::slice::from_raw_parts_mut(r.ptr.add(span.offset), span.len) }
    }
}

/// The error of an execution that saw no progress for `waited`: it names
/// the step it waits on (the first unfinished receive: what a silent peer
/// starves).
pub(crate) fn timeout_error(
    exec: &Execution<Request>,
    sched: &Schedule,
    waited: Duration,
) -> transport::Error {
    let w = exec
        .waiting_on(sched)
        .expect("an unfinished execution waits on something");
    let (what, dir) = if w.send {
        ("send", "to")
    } else {
        ("receive", "from")
    };
    transport::Error::Timeout {
        peer: w.peer,
        waited,
        waiting_for: format!(
            "{what} {} of {} {dir} it, {} bytes, not complete",
            w.index, w.of, w.bytes
        ),
    }
}

fn involved_connections<'b>(
    peers: &'b mut [Option<Box<dyn Connection>>],
    involved: &'b [bool],
) -> impl Iterator<Item = &'b mut Box<dyn Connection>> + 'b {
    peers
        .iter_mut()
        .zip(involved)
        .filter(|(_, inv)| **inv)
        .filter_map(|(c, _)| c.as_mut())
}

fn connection(
    peers: &mut [Option<Box<dyn Connection>>],
    peer: Rank,
) -> transport::Result<&mut Box<dyn Connection>> {
    peers
        .get_mut(peer)
        .and_then(|c| c.as_mut())
        .ok_or_else(|| transport::Error::Invalid(format!("no connection to rank {peer}")))
}
