//! Group calls (NCCL's `ncclGroupStart`/`ncclGroupEnd`): calls recorded
//! together run together. [`Group::end`] starts every call before it waits
//! for any, so sends and receives to any peers, in any order, are all in
//! flight at once and nothing waits on an order between peers (a ring
//! exchange cannot deadlock); collectives keep their order. Sends to and
//! receives from this rank itself are matched in order and copied. Small
//! AllReduces of one datatype and reduction are fused: one AllReduce of a
//! packed buffer instead of one latency each (as DDP's buckets are). The
//! first error is returned at the end, naming its peer and call.
//!
//! ```no_run
//! # use collectives::{Communicator, ReduceOp};
//! # let mut comm = Communicator::from_env()?;
//! let (n, me) = (comm.size(), comm.rank());
//! let (out, mut got) = (vec![1.0f32; 1 << 20], vec![0.0f32; 1 << 20]);
//! let mut g = comm.group();
//! g.send(&out, (me + 1) % n)?;
//! g.recv(&mut got, (me + n - 1) % n)?;
//! g.end()?;
//! # Ok::<(), collectives::Error>(())
//! ```

use std::marker::PhantomData;

use transport::Rank;

use crate::call::args::{CallArgs, Peer};
use crate::comm::inflight::{CallId, RawBuf};
use crate::{Collective, Communicator, Element, Error, ReduceOp, Result};

/// AllReduces up to this size are fused within a group: above it, one call
/// per buffer costs no more than the packing copies.
pub const FUSE_MAX_BYTES: usize = 256 << 10;

/// One recorded call.
struct Entry {
    args: CallArgs,
    input: Option<RawBuf>,
    output: RawBuf,
}

/// Calls recorded on a communicator, run together by [`end`](Self::end).
/// The buffers are borrowed for the group's lifetime.
#[must_use = "a group runs nothing until end()"]
pub struct Group<'a> {
    comm: &'a mut Communicator,
    entries: Vec<Entry>,
    /// Workspace lent to calls that need it (a Reduce's receive buffer off
    /// the root), alive until the group ends.
    workspace: Vec<Vec<u64>>,
    buffers: PhantomData<&'a mut [u8]>,
}

impl Communicator {
    /// Starts a group of calls (see [`Group`]).
    pub fn group(&mut self) -> Group<'_> {
        Group {
            comm: self,
            entries: Vec::new(),
            workspace: Vec::new(),
            buffers: PhantomData,
        }
    }
}

impl<'a> Group<'a> {
    /// Records `buf` sent to `peer` (this rank included).
    pub fn send<T: Element>(&mut self, buf: &'a [T], peer: Rank) -> Result<()> {
        let input = RawBuf::of(bytemuck::cast_slice(buf));
        self.record(
            CallArgs::send_to(T::DTYPE, peer),
            Some(input),
            RawBuf::of_mut(&mut []),
        )
    }

    /// Records a receive from `peer` (this rank included) into `buf`.
    pub fn recv<T: Element>(&mut self, buf: &'a mut [T], peer: Rank) -> Result<()> {
        let output = RawBuf::of_mut(bytemuck::cast_slice_mut(buf));
        self.record(CallArgs::recv_from(T::DTYPE, peer), None, output)
    }

    /// Records an in-place AllReduce of `buf`.
    pub fn all_reduce_in_place<T: Element>(
        &mut self,
        buf: &'a mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let args = CallArgs::new(Collective::AllReduce, T::DTYPE).op(op);
        self.record(args, None, RawBuf::of_mut(bytemuck::cast_slice_mut(buf)))
    }

    /// Records an AllReduce of `send` into `recv`.
    pub fn all_reduce<T: Element>(
        &mut self,
        send: &'a [T],
        recv: &'a mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let args = CallArgs::new(Collective::AllReduce, T::DTYPE).op(op);
        let input = RawBuf::of(bytemuck::cast_slice(send));
        self.record(
            args,
            Some(input),
            RawBuf::of_mut(bytemuck::cast_slice_mut(recv)),
        )
    }

    /// Records any call on byte buffers (see [`Communicator::call`]).
    pub fn call(&mut self, args: &CallArgs, bufs: crate::Buffers<'a>) -> Result<()> {
        let (input, output) = RawBuf::from_buffers(bufs);
        self.record(args.clone(), input, output)
    }

    /// Records any call with NCCL's buffer conventions (see
    /// [`Communicator::call_raw`]).
    ///
    /// # Safety
    /// As [`Communicator::call_raw`], until [`end`](Self::end) returns.
    pub unsafe fn call_raw(
        &mut self,
        args: &CallArgs,
        send: *const u8,
        recv: *mut u8,
        count: usize,
    ) -> Result<()> {
        let mut workspace = Vec::new();
        // SAFETY: the caller's promise.
        let (input, output) = unsafe {
            self.comm
                .nccl_bufs(args, send, recv, count, &mut workspace)?
        };
        if !workspace.is_empty() {
            // Its heap memory stays where it is when the Vec moves.
            self.workspace.push(workspace);
        }
        self.record(args.clone(), input, output)
    }

    fn record(&mut self, args: CallArgs, input: Option<RawBuf>, output: RawBuf) -> Result<()> {
        self.entries.push(Entry {
            args,
            input,
            output,
        });
        Ok(())
    }

    /// Runs the group: copies between this rank and itself, one packed
    /// AllReduce per fusable (datatype, reduction), then every other call
    /// started at once and all waited for. Returns the first error.
    pub fn end(self) -> Result<()> {
        let Group {
            comm, mut entries, ..
        } = self;
        let (rank, size) = (comm.rank(), comm.size());
        copy_to_self(rank, &mut entries)?;
        let mut fused = fuse(&mut entries, |e| {
            // SAFETY: the caller's buffers, for the group's lifetime.
            let (i, o) = unsafe { (e.input.map(|b| b.bytes()), e.output.bytes()) };
            e.args.check(rank, size, i, o).is_ok()
        });
        // Each call's start, in call order: a call that fails as it begins
        // aborts the communicator, and the calls started after it are
        // refused for that; the first error in call order is the cause.
        let mut started: Vec<Result<CallId>> = Vec::with_capacity(entries.len());
        for entry in entries.iter().chain(fused.iter().map(|f| &f.entry)) {
            // SAFETY: the buffers are borrowed for 'a (or owned by `fused`),
            // and every started call is waited for below.
            started.push(unsafe { comm.start(&entry.args, entry.input, entry.output) });
        }
        let mut first_error = None;
        for call in started {
            if let Err(e) = call.and_then(|id| comm.wait(id)) {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => {
                fused.iter_mut().for_each(Fused::unpack);
                Ok(())
            }
        }
    }
}

/// Pairs this rank's sends to itself with its receives from itself, in
/// order, and copies them; removes them from `entries`.
fn copy_to_self(rank: Rank, entries: &mut Vec<Entry>) -> Result<()> {
    let to_self = |e: &Entry, want: Peer| e.args.peer == Some(want);
    let sends: Vec<usize> = (0..entries.len())
        .filter(|&i| to_self(&entries[i], Peer::To(rank)))
        .collect();
    let recvs: Vec<usize> = (0..entries.len())
        .filter(|&i| to_self(&entries[i], Peer::From(rank)))
        .collect();
    let invalid = |message: String| Error::InvalidArgument { rank, message };
    if sends.len() != recvs.len() {
        return Err(invalid(format!(
            "rank {rank} sends itself {} message(s) but receives {} in the group",
            sends.len(),
            recvs.len()
        )));
    }
    for (&s, &r) in sends.iter().zip(&recvs) {
        let (from, to) = (
            entries[s].input.expect("a send has input"),
            entries[r].output,
        );
        if from.len != to.len || entries[s].args.dtype != entries[r].args.dtype {
            return Err(invalid(format!(
                "rank {rank} sends itself {} bytes of {} but receives {} bytes of {}",
                from.len, entries[s].args.dtype, to.len, entries[r].args.dtype
            )));
        }
        // SAFETY: both buffers are the caller's for the group's lifetime; a
        // send and a receive of one group never share memory.
        unsafe { std::ptr::copy_nonoverlapping(from.ptr, to.ptr, from.len) };
    }
    let mut mine: Vec<usize> = sends.into_iter().chain(recvs).collect();
    mine.sort_unstable();
    for i in mine.into_iter().rev() {
        entries.remove(i);
    }
    Ok(())
}

/// AllReduces of one (datatype, reduction) packed into one buffer.
struct Fused {
    entry: Entry,
    pack: Vec<u64>,
    /// (offset in the pack, the caller's output).
    parts: Vec<(usize, RawBuf)>,
}

impl Fused {
    /// Copies each part of the reduced pack back to its caller's buffer.
    fn unpack(&mut self) {
        let pack: &[u8] = bytemuck::cast_slice(&self.pack);
        for &(at, out) in &self.parts {
            // SAFETY: the caller's output buffer, for the group's lifetime.
            let out = unsafe { std::slice::from_raw_parts_mut(out.ptr, out.len) };
            out.copy_from_slice(&pack[at..at + out.len()]);
        }
    }
}

/// Takes the small AllReduces out of `entries`, two or more per (datatype,
/// reduction), and packs each set into one call. Calls `valid` rejects stay
/// (their own start reports why).
fn fuse(entries: &mut Vec<Entry>, valid: impl Fn(&Entry) -> bool) -> Vec<Fused> {
    let small = |e: &Entry| {
        e.args.collective == Collective::AllReduce && e.output.len <= FUSE_MAX_BYTES && valid(e)
    };
    let mut keys: Vec<_> = entries
        .iter()
        .filter(|e| small(e))
        .map(|e| (e.args.dtype, e.args.op))
        .collect();
    keys.dedup();
    let mut fused = Vec::new();
    for (dtype, op) in keys {
        let same = |e: &Entry| small(e) && e.args.dtype == dtype && e.args.op == op;
        if entries.iter().filter(|e| same(e)).count() < 2 {
            continue;
        }
        let members: Vec<Entry> = extract(entries, same);
        let total: usize = members.iter().map(|e| e.output.len).sum();
        let mut pack = vec![0u64; total.div_ceil(8)];
        let bytes: &mut [u8] = &mut bytemuck::cast_slice_mut(&mut pack)[..total];
        let mut parts = Vec::with_capacity(members.len());
        let mut at = 0;
        for e in &members {
            let from = e.input.unwrap_or(e.output);
            // SAFETY: the caller's buffer, for the group's lifetime.
            bytes[at..at + from.len]
                .copy_from_slice(unsafe { std::slice::from_raw_parts(from.ptr, from.len) });
            parts.push((at, e.output));
            at += from.len;
        }
        let output = RawBuf::of_mut(bytes);
        fused.push(Fused {
            entry: Entry {
                args: members[0].args.clone(),
                input: None,
                output,
            },
            pack,
            parts,
        });
    }
    fused
}

/// Removes and returns the entries `keep` selects, in order.
fn extract(entries: &mut Vec<Entry>, keep: impl Fn(&Entry) -> bool) -> Vec<Entry> {
    let (taken, rest): (Vec<Entry>, Vec<Entry>) = entries.drain(..).partition(|e| keep(e));
    *entries = rest;
    taken
}
