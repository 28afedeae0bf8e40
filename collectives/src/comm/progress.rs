//! Calls in flight making progress: one executor step over every running
//! call, sleeping until a connection or the doorbell has news, beginning
//! queued calls, and finishing or failing them (a stall, a timeout, an
//! abort), with the flight record and the status board kept current.
//! Starting a call is in `inflight.rs`.

use std::os::fd::BorrowedFd;

use transport::Phase;

use crate::algo::{self, Layout};
use crate::bootstrap::mesh::Lane;
use crate::call::descriptor::Collective;
use crate::exec::executor::{Progress, Windows};
use crate::exec::transfers::{self, Region, Transfers};
use crate::observe::recorder;
use crate::tiny::Tiny;
use crate::{Communicator, Error, ReduceOp, Result};

use super::inflight::*;

impl Communicator {
    /// The result of `id` if it finished (the call is then forgotten).
    pub(crate) fn take_result(&mut self, id: CallId) -> Option<Result<()>> {
        let calls = &mut self.inflight.calls;
        let at = calls.iter().position(|c| c.id == id)?;
        if !matches!(calls[at].state, State::Finished(_)) {
            return None;
        }
        let State::Finished(r) = std::mem::replace(&mut calls[at].state, State::Queued) else {
            unreachable!()
        };
        // The newest call (a blocking caller's) is dropped where it lies:
        // moving a call out costs copies a small call notices.
        match at + 1 == calls.len() {
            true => calls.truncate(at),
            false => drop(calls.remove(at)),
        }
        Some(r)
    }

    /// Drives every call in flight until `id` finished, and returns its result.
    pub(crate) fn wait(&mut self, id: CallId) -> Result<()> {
        loop {
            if let Some(result) = self.take_result(id) {
                return result;
            }
            if !self.step_all() {
                self.idle(None);
            }
        }
    }

    /// One executor step of every running call. Returns whether anything
    /// moved (or finished).
    pub(crate) fn step_all(&mut self) -> bool {
        if let Some(reason) = self.abort.reason() {
            self.close(&reason);
            return true;
        }
        if recorder::dump_requests() > self.recorder.dumps_seen {
            self.recorder.dumps_seen = recorder::dump_requests();
            self.dump_logged("SIGUSR1");
        }
        let mut moved = false;
        for at in 0..self.inflight.calls.len() {
            let call = &mut self.inflight.calls[at];
            if let State::Flags(flags) = &mut call.state {
                let tiny = self.tiny.on_mut().expect("a flag call has the flag path");
                let (before, desc) = (flags.mark(), call.desc);
                match poll_flags(tiny, flags, &desc, call.input, call.output) {
                    Ok(true) => self.finish(at, Ok(())),
                    Ok(false) if flags.mark() == before => continue,
                    Ok(false) => {}
                    Err(e) => {
                        self.fail(at, Error::collective(self.rank, desc, e));
                        return true;
                    }
                }
                moved = true;
                continue;
            }
            let State::Running(run) = &mut call.state else {
                continue;
            };
            let desc = call.desc;
            let mut fx = Transfers {
                recorder: &mut self.recorder,
                lane: run.lane,
                peers: &mut self.links.lanes[run.lane],
                input: run.input.as_ref(),
                output: run.output.as_ref().expect("a running call has its output"),
                scratch: run.scratch.as_ref(),
                staging: &self.links.staging,
                dtype: desc.dtype,
                op: desc.op.unwrap_or(ReduceOp::Sum),
                nranks: self.size,
                tag: desc.tag(),
            };
            match run.exec.progress(&run.sched, &mut fx) {
                Ok(Progress::Idle) => {}
                Ok(Progress::Moved) => moved = true,
                Ok(Progress::Done) => {
                    moved = true;
                    self.finish(at, Ok(()));
                }
                Err(e) => {
                    let e = Error::collective(self.rank, desc, e);
                    self.fail(at, e);
                    return true;
                }
            }
        }
        if moved {
            self.inflight.poller.busy();
            self.begin_ready();
        }
        moved
    }

    /// Waits for a connection of a running call (or `extra`) to be ready,
    /// after spinning and yielding; fails the oldest running call once
    /// nothing moved for the timeout.
    pub(crate) fn idle(&mut self, extra: Option<BorrowedFd<'_>>) {
        if self.inflight.poller.spin() {
            return;
        }
        if let Some(at) =
            (self.inflight.calls.iter()).position(|c| matches!(c.state, State::Flags(_)))
        {
            return self.idle_flags(at);
        }
        let Some(oldest) =
            (self.inflight.calls.iter()).position(|c| matches!(c.state, State::Running(_)))
        else {
            return;
        };
        for (lane, flags) in self.inflight.involved.iter_mut().enumerate() {
            flags.clear();
            flags.resize(self.size, false);
            for c in &self.inflight.calls {
                if let State::Running(r) = &c.state {
                    if r.lane == lane {
                        (flags.iter_mut().zip(r.exec.involved())).for_each(|(f, i)| *f |= *i);
                    }
                }
            }
        }
        let involved = &self.inflight.involved;
        let conns = (self.links.lanes.iter_mut().zip(involved))
            .flat_map(|(lane, flags)| lane.iter_mut().zip(flags))
            .filter(|(_, i)| **i)
            .filter_map(|(c, _)| c.as_mut());
        let wake = [self.abort.wake_fd()];
        let extra = extra.into_iter().chain(wake);
        let timeout = self.config.timeout;
        let idled = std::time::Instant::now();
        let tiny = self.tiny.on();
        let alone = || tiny.is_some_and(Tiny::alone_on_cpu);
        let idle = self.inflight.poller.idle(conns, extra, timeout, alone);
        self.recorder.stats.wait_seconds += idled.elapsed().as_secs_f64();
        match idle {
            Ok(true) if self.inflight.poller.asleep() => self.publish_wait(oldest),
            Ok(true) => {}
            Ok(false) => {
                let State::Running(run) = &self.inflight.calls[oldest].state else {
                    unreachable!()
                };
                let waited = self.inflight.poller.idle_for();
                let source = transfers::timeout_error(&run.exec, &run.sched, waited);
                self.stall(oldest, source);
            }
            Err(e) => {
                let e = Error::collective(self.rank, self.inflight.calls[oldest].desc, e);
                self.fail(oldest, e);
            }
        }
    }

    /// Waits for the flag call `at`: spins, then sleeps on the flag it
    /// waits for (woken by its writer), but not long while other calls
    /// run (they wake through descriptors). A peer gone, on the general
    /// path for this call, or aborted fails the call, and so does the timeout.
    pub(super) fn idle_flags(&mut self, at: usize) {
        let phase = self.inflight.poller.phase(self.config.timeout);
        let tiny = self.tiny.on().expect("a flag call has the flag path");
        let call = &self.inflight.calls[at];
        let State::Flags(flags) = &call.state else {
            unreachable!("idle_flags is called for a flag call")
        };
        // Polling goes on for the poller's patience: a sleeping reader
        // makes its writer pay a wake-up, and a late reader the next
        // writer, a convoy. Yielding would hand a core shared with other
        // work to that work for a whole time slice: only a rank whose peer
        // last ran on its core yields, and at once (`Tiny::yields_core`).
        match phase {
            Phase::Spin | Phase::Yield if tiny.yields_core(flags) => {
                return std::thread::yield_now()
            }
            Phase::Spin | Phase::Yield => return std::hint::spin_loop(),
            Phase::Sleep(_) | Phase::Expired => {}
        }
        let (desc, peer) = (call.desc, flags.peer());
        // A peer that published what we wait for and then left (it finished
        // and exited) is no failure: the next poll takes its part.
        let checked = match tiny.check(flags) {
            Ok(true) => return,
            checked => checked.map(|_| ()),
        };
        // A peer's abort shows on its connection, with its reason (read
        // after the check: a peer that left aborted its connections first).
        let lane = &mut self.links.lanes[Lane::Collective as usize];
        let connection = lane[peer]
            .as_mut()
            .map_or(Ok(()), |c| c.progress().map(|_| ()));
        let others = (self.inflight.calls.iter()).any(|c| matches!(c.state, State::Running(_)));
        match (connection.and(checked), phase) {
            (Err(e), _) => self.fail(at, Error::collective(self.rank, desc, e)),
            (Ok(()), Phase::Expired) => {
                let waited = self.inflight.poller.idle_for();
                let waiting_for = format!("its part of {desc}, by shared flags");
                self.stall(
                    at,
                    transport::Error::Timeout {
                        peer,
                        waited,
                        waiting_for,
                    },
                );
            }
            (Ok(()), _) if others => tiny.sleep(flags, FLAG_SLEEP_WITH_OTHERS),
            (Ok(()), _) => {
                tiny.sleep(flags, FLAG_SLEEP);
                self.publish_wait(at);
            }
        }
    }

    /// Call `at` saw no progress for the timeout (`source` says on what):
    /// fails it with every rank's answer to where it is.
    pub(super) fn stall(&mut self, at: usize, source: transport::Error) {
        self.recorder.stats.timeouts += 1;
        self.publish_wait(at);
        let op = self.inflight.calls[at].desc;
        tracing::warn!(
            rank = self.rank,
            "{op} timed out; asking every rank where it is"
        );
        let cause = crate::observe::status::diagnose(
            self.rank,
            self.recorder.board.position(),
            &self.status_addresses(),
            self.ids.session,
        );
        let rank = self.rank;
        let source = Box::new(source);
        let e = Error::Stalled {
            rank,
            op,
            source,
            cause,
        };
        self.fail(at, e);
    }

    /// Puts what call `at` waits on where the other ranks can ask (only
    /// when the rank sleeps: a long wait).
    pub(super) fn publish_wait(&self, at: usize) {
        let call = &self.inflight.calls[at];
        let waiting = match &call.state {
            State::Running(run) => run.exec.waiting_on(&run.sched),
            State::Flags(flags) => Some(flags.waiting()),
            _ => None,
        };
        if let Some(w) = waiting {
            self.recorder.board.waiting(call.desc.tag(), &w);
        }
    }

    /// Call `at` failed with `e`: the communicator is aborted (telling the
    /// peers why) and every other call fails with it.
    pub(super) fn fail(&mut self, at: usize, e: Error) {
        if let Error::Collective {
            source: transport::Error::Io {
                what: "completion", ..
            },
            ..
        } = &e
        {
            self.recorder.stats.completion_errors += 1;
        }
        let reason = root_cause(&e);
        // Dumped while the call still shows what it waits on.
        self.dump_logged(&e.to_string());
        self.finish(at, Err(e));
        self.close(&reason);
    }

    /// Dumps the flight record, saying where in the log (failures only
    /// warn: the caller gets the error itself).
    pub(super) fn dump_logged(&self, reason: &str) {
        match self.dump_trace(reason) {
            Ok(path) => tracing::warn!(
                rank = self.rank,
                "flight record dumped to {} (collbench trace {} merges every rank's)",
                path.display(),
                recorder::dump_dir().display()
            ),
            Err(e) => tracing::warn!(rank = self.rank, "could not dump the flight record: {e}"),
        }
    }

    /// What the running call recorded as number `n` waits on.
    pub(crate) fn waiting_on(&self, n: u64) -> Option<crate::observe::waiting::Waiting> {
        let call = self.inflight.calls.iter().find(|c| c.slot.number() == n)?;
        match &call.state {
            State::Running(run) => run.exec.waiting_on(&run.sched),
            State::Flags(flags) => Some(flags.waiting()),
            _ => None,
        }
    }

    pub(super) fn finish(&mut self, at: usize, result: Result<()>) {
        let ok = result.is_ok();
        self.recorder.finished(self.inflight.calls[at].slot, ok);
        let state = std::mem::replace(&mut self.inflight.calls[at].state, State::Finished(result));
        if let State::Running(mut run) = state {
            if let (Some(out), true) = (run.copy_out, ok) {
                // The reduce-scatter's whole-size buffer holds every block.
                let whole = bytemuck::cast_slice::<u64, u8>(&self.workspace.reduce_scatter_buf);
                let (mine, len) = (self.rank * out.len, out.len);
                // SAFETY: `out` is the caller's receive buffer of `len` bytes,
                // still reserved for this call.
                let out = unsafe { std::slice::from_raw_parts_mut(out.ptr_or_dangling(), len) };
                out.copy_from_slice(&whole[mine..mine + len]);
            }
            run.input = None;
            run.output = None;
            self.inflight.spare.push(run);
        }
    }

    /// Runs every call whose turn has come: all point-to-point calls, and
    /// the oldest unfinished collective once nothing is ahead of it.
    pub(super) fn begin_ready(&mut self) {
        let mut collective_busy = false;
        for at in 0..self.inflight.calls.len() {
            let call = &self.inflight.calls[at];
            let p2p = call.args.collective == Collective::PointToPoint;
            match call.state {
                State::Running(_) | State::Flags(_) if !p2p => collective_busy = true,
                State::Queued if p2p || !collective_busy => {
                    if !p2p {
                        collective_busy = true;
                    }
                    if let Err(e) = self.begin(at) {
                        self.fail(at, e);
                        return;
                    }
                }
                _ => {}
            }
        }
    }

    /// Chooses the call's algorithm, builds its schedule, registers its
    /// buffers and starts its execution.
    pub(super) fn begin(&mut self, at: usize) -> Result<()> {
        if self.begin_flags(at)? {
            return Ok(());
        }
        let rank = self.rank;
        let call = &mut self.inflight.calls[at];
        let (desc, peer, counts) = (call.desc, call.args.peer, call.args.counts.take());
        let (mut input, mut output) = (call.input, call.output);
        let elem = desc.dtype.size();
        let larger = call.larger();
        let (chunk_bytes, slots) = self.pipeline(desc.collective, larger);
        let (build, in_place_ok, lane, windows, algo_name) = match desc.collective {
            Collective::PointToPoint => (
                algo::POINT_TO_POINT,
                true,
                Lane::PointToPoint,
                Windows {
                    sends: usize::MAX,
                    recvs: usize::MAX,
                    slots: 0,
                },
                "p2p",
            ),
            c => {
                let algo = self.selector.choose_cached(&self.config, c, larger)?;
                let windows = Windows {
                    sends: transfers::SEND_WINDOW.max(self.config.depth),
                    recvs: self.config.depth,
                    slots,
                };
                (
                    algo.build,
                    algo.in_place,
                    Lane::Collective,
                    windows,
                    algo.name,
                )
            }
        };
        let mut copy_out = None;
        if let (Some(send), Collective::ReduceScatter) = (input, desc.collective) {
            grow(&mut self.workspace.reduce_scatter_buf, send.len);
            copy_out = Some(output);
            output = RawBuf {
                ptr: self.workspace.reduce_scatter_buf.as_mut_ptr().cast(),
                len: send.len,
            };
        }
        if input.is_none() && !in_place_ok {
            // An algorithm that cannot run in place gets a copy of the input.
            grow(&mut self.workspace.scratch, output.len);
            let copy = &mut bytemuck::cast_slice_mut(&mut self.workspace.scratch)[..output.len];
            // SAFETY: the caller's buffer, reserved for this call.
            copy.copy_from_slice(unsafe { output.bytes() });
            input = Some(RawBuf::of(copy));
        }
        let layout = Layout {
            rank,
            size: self.size,
            count: desc.count as usize,
            elem,
            chunk: (chunk_bytes / elem).max(1) * elem,
            in_place: input.is_none(),
            root: desc.root.map_or(0, usize::from),
            hosts: &self.job.hosts,
            call: desc,
            counts: counts.as_ref(),
            peer,
        };
        let mut run = self.inflight.spare.pop().unwrap_or_default();
        run.sched.clear();
        build(&layout, &mut run.sched);
        let slot = self.inflight.calls[at].slot;
        self.recorder.running(slot, algo_name, layout.chunk);
        tracing::debug!(rank, call = %desc, chunk = layout.chunk, steps = run.sched.len(), "start");
        self.inflight.calls[at].args.counts = counts;
        // The sender may write what a reduction receives (see
        // `MemRegion::allow_peer_writes`): the receiver then reduces one
        // chunk while the next is copied in. Not what is only copied: read
        // by the receiver, it lands in the receiver's own cache; unless
        // our core is shared with other work, where our copies crawl and a
        // sender with a core of its own is better placed to make them
        // (2-rank Broadcast of 16 MiB beside a busy loop: 0.70-0.78x the time),
        // or from a sender with nothing else to do (`Schedule::sender_writes`).
        // Staging slots follow the call's buffers (`Transfers::post`).
        let sender_writes = run.sched.sender_writes;
        let written = Access {
            peer_writes: desc.collective.reduces() || sender_writes || transport::core_shared(),
            ..Access::default()
        };
        // The input's sends only, out of place: in place, a block read in
        // place holds up the staged receive that overwrites it (4-rank
        // AllToAll of 128 KiB: 1.74x the time; out of place 0.80x). And a
        // root whose peers offer it their copies (`sender_writes`) declines
        // them for sends out of an input: it copies that to its output meanwhile.
        let read = Access {
            all_in_flight: run.sched.all_in_flight,
            declines_help: sender_writes,
            ..Access::default()
        };
        run.input = match input {
            Some(b) => Some(
                self.region(b, read)
                    .map_err(|e| Error::collective(rank, desc, e))?,
            ),
            None => None,
        };
        run.output = Some(
            self.region(output, written)
                .map_err(|e| Error::collective(rank, desc, e))?,
        );
        run.scratch = match run.sched.scratch {
            0 => None,
            bytes => {
                grow(&mut run.scratch_buf, bytes);
                let b = RawBuf {
                    ptr: run.scratch_buf.as_mut_ptr().cast(),
                    len: bytes,
                };
                Some(
                    self.region(b, written)
                        .map_err(|e| Error::collective(rank, desc, e))?,
                )
            }
        };
        run.lane = lane as usize;
        run.copy_out = copy_out;
        run.exec.start(&run.sched, self.size, windows);
        let lane = lane as usize;
        let unconnected =
            |(p, (i, c)): (usize, (&bool, &Option<_>))| *i && c.is_none() && p != rank;
        let conns = run.exec.involved().iter().zip(&self.links.lanes[lane]);
        if conns.enumerate().any(unconnected) {
            self.connect_for(run.exec.involved(), lane)
                .map_err(|e| Error::collective(rank, desc, e))?;
        }
        self.inflight.calls[at].state = State::Running(run);
        Ok(())
    }

    /// Connects, on `lane`, to the peers flagged in `involved` that have no
    /// connection yet: the first call to need a peer pays for it.
    #[cold]
    fn connect_for(&mut self, involved: &[bool], lane: usize) -> transport::Result<()> {
        let rank = self.rank;
        let peers: Vec<usize> = (involved.iter().enumerate())
            .filter(|&(p, i)| *i && p != rank)
            .map(|(p, _)| p)
            .collect();
        let deadline = std::time::Instant::now() + self.config.timeout;
        (self.links).connect(lane, &peers, &self.job.via, deadline)
    }

    /// On a communicator with the flag path, starts call `at` there if it
    /// takes it (returns whether it did), or says it takes the general path.
    pub(super) fn begin_flags(&mut self, at: usize) -> Result<bool> {
        let call = &mut self.inflight.calls[at];
        let Some(tiny) = self.tiny.on_mut() else {
            return Ok(false);
        };
        let bytes = call.larger();
        if call.desc.collective == Collective::PointToPoint {
            return Ok(false);
        }
        if !tiny.takes(call.desc.collective, bytes) {
            tiny.mark_general(&call.desc, bytes);
            return Ok(false);
        }
        let mut flags = tiny.number(&call.desc, bytes, call.input.is_none());
        post_flags(tiny, &mut flags, call.input, call.output)
            .map_err(|e| Error::collective(self.rank, call.desc, e))?;
        call.state = State::Flags(flags);
        self.recorder.running(call.slot, "tiny", bytes);
        Ok(true)
    }

    /// `b` as the executor sees it: registered with every transport in use
    /// (or found in the registration cache), flagged for the use `access`
    /// says.
    pub(super) fn region(&mut self, b: RawBuf, access: Access) -> transport::Result<Region> {
        let ptr = b.ptr_or_dangling();
        let mut mr = match self.links.registrations.lookup(ptr, b.len) {
            Some(mr) => mr,
            None => {
                let mr = transport::register_all(
                    self.links.transports.iter().map(|t| &**t),
                    ptr,
                    b.len,
                )?;
                self.recorder.stats.registrations += mr.is_registered() as u64;
                mr
            }
        };
        // A failed call aborts its connections, which takes back every
        // offer to write, before the caller gets its buffers back.
        if access.peer_writes {
            mr = mr.allow_peer_writes();
        }
        if access.all_in_flight {
            mr = mr.all_in_flight();
        }
        if access.declines_help {
            mr = mr.declines_help();
        }
        Ok(Region {
            ptr,
            len: b.len,
            mr,
        })
    }
}
