//! The discrete-event engine: every rank's schedule run by the executor
//! itself, its [`Effects`] carried out on a virtual clock.
//!
//! A rank runs (executor steps until nothing moves) when it is woken: at
//! the start, and when a transfer it waits on completes. Posting a transfer
//! matches it with the peer's in posting order (both ends of a connection
//! post matching steps in the same order); once both ends posted, the
//! model fixes when it completes. Only the transfers at the heads of a
//! rank's queues can let it move (the executor retires each queue in
//! order), so a rank that stops is woken once, when the first of those
//! completes ([`Agenda::wake`]), not once per transfer.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use transport::{Rank, Tag};

use super::agenda::Agenda;
use super::model::{Cluster, Link, Ports};
use crate::algo::schedule::{Action, Schedule, Span, Step};
use crate::exec::executor::{Effects, Execution, Progress, Source};
use crate::sys::prefetch::prefetch;

/// One rank of the simulation.
pub(super) struct Member {
    pub sched: Schedule,
    pub exec: Execution<u32>,
    /// When its CPU is next free.
    pub now: f64,
    pub finished: Option<f64>,
}

/// A message: posted by one end or both.
#[derive(Clone, Copy)]
struct Transfer {
    send_posted: f64,
    recv_posted: f64,
    /// When the last byte landed; infinite until both ends posted.
    done: f64,
    /// As posted by the end that posted first.
    bytes: usize,
    src: u32,
    /// Ends (bit 0 the sender, bit 1 the receiver) that have not yet seen
    /// it complete: it is free once both have.
    unseen: u8,
}

impl Transfer {
    fn end(&self, rank: u32) -> u8 {
        if rank == self.src {
            1
        } else {
            2
        }
    }
}

/// Posts one end has made that the other has not matched yet: only one
/// end's at a time (the other's would have matched them).
#[derive(Default)]
struct Channel {
    pending: VecDeque<u32>,
    /// Whether `pending` holds sends, else receives.
    sends: bool,
}

/// Everything ranks share: messages, ports, the event queue.
struct World<'c> {
    cluster: &'c Cluster,
    transfers: Vec<Transfer>,
    free: Vec<u32>,
    channels: HashMap<u64, Channel, BuildHasherDefault<PairHasher>>,
    nics: Ports,
    shm: Ports,
    wakeups: Agenda,
    messages: u64,
}

/// What a run produced.
pub(super) struct Outcome {
    /// When the last rank finished, seconds.
    pub seconds: f64,
    /// Messages carried.
    pub messages: u64,
    /// Times a rank was woken to run its executor.
    pub events: u64,
}

/// How far a run is, for progress reports: rank wake-ups so far, messages
/// carried, and the simulated time reached.
#[derive(Clone, Copy, Debug)]
pub struct Status {
    pub events: u64,
    pub messages: u64,
    pub seconds: f64,
}

/// Wake-ups between calls of a progress callback.
const REPORT_EVERY: u64 = 1 << 20;

/// Runs every member's schedule (its execution started) to completion,
/// calling `report` every [`REPORT_EVERY`] wake-ups.
pub(super) fn run(
    cluster: &Cluster,
    members: &mut [Member],
    report: &mut dyn FnMut(Status),
) -> Result<Outcome, String> {
    let mut world = World {
        cluster,
        transfers: Vec::new(),
        free: Vec::new(),
        channels: HashMap::default(),
        nics: Ports::new(cluster.hosts()),
        shm: Ports::new(cluster.ranks),
        wakeups: Agenda::new(members.len() as u32),
        messages: 0,
    };
    let mut events = 0;
    while let Some((at, rank)) = world.wakeups.pop() {
        prefetch_soon(&world.wakeups, members);
        let m = &mut members[rank as usize];
        if m.finished.is_some() {
            continue;
        }
        events += 1;
        m.now = m.now.max(at);
        if events % REPORT_EVERY == 0 {
            report(Status {
                events,
                messages: world.messages,
                seconds: m.now,
            });
        }
        let mut fx = RankEffects {
            me: rank,
            now: m.now,
            world: &mut world,
        };
        loop {
            let progress =
                (m.exec.progress(&m.sched, &mut fx)).map_err(|e| format!("rank {rank}: {e}"))?;
            match progress {
                Progress::Moved => continue,
                Progress::Done => m.finished = Some(fx.now),
                Progress::Idle => {
                    let first = (m.exec.awaited())
                        .map(|t| fx.world.transfers[t as usize].done)
                        .fold(f64::INFINITY, f64::min);
                    fx.world.wakeups.wake(rank, first);
                }
            }
            break;
        }
        m.now = fx.now;
    }
    if let Some(r) = members.iter().position(|m| m.finished.is_none()) {
        let w = members[r].exec.waiting_on(&members[r].sched);
        return Err(format!(
            "deadlock: rank {r} never finished (waiting on {w:?}): the schedules do not match"
        ));
    }
    Ok(Outcome {
        seconds: members
            .iter()
            .filter_map(|m| m.finished)
            .fold(0.0, f64::max),
        messages: world.messages,
        events,
    })
}

/// Starts loading the state of the ranks that run next while this one runs:
/// each wake-up touches a rank's member, cursors, step ids, steps and
/// states, and with thousands of ranks none are in cache (a 4096-rank ring:
/// 85 s without). A rank moves one place nearer the front of the agenda per
/// wake-up, so each place loads what the place behind it made readable:
/// the member at the back, the executor's stages nearer the front.
fn prefetch_soon(agenda: &Agenda, members: &[Member]) {
    for (place, rank) in agenda.soon().enumerate() {
        let m = &members[rank as usize];
        match place {
            0 => m.exec.prefetch(&m.sched, 3),
            1 => m.exec.prefetch(&m.sched, 2),
            3 => m.exec.prefetch(&m.sched, 1),
            5 => m.exec.prefetch(&m.sched, 0),
            7 => {
                let lines = std::mem::size_of::<Member>().div_ceil(64);
                let first = (m as *const Member).cast::<[u8; 64]>();
                (0..lines).for_each(|l| prefetch(first.wrapping_add(l)));
            }
            _ => {}
        }
    }
}

/// One rank's view of the world while its executor steps.
struct RankEffects<'w, 'c> {
    me: u32,
    now: f64,
    world: &'w mut World<'c>,
}

impl World<'_> {
    fn new_transfer(&mut self, t: Transfer) -> u32 {
        match self.free.pop() {
            Some(id) => {
                self.transfers[id as usize] = t;
                id
            }
            None => {
                self.transfers.push(t);
                (self.transfers.len() - 1) as u32
            }
        }
    }

    /// A send from `src` or a receive at `dst` posted at `at`: matched with
    /// the other end's oldest unmatched post, or queued until it comes.
    fn post(
        &mut self,
        src: u32,
        dst: u32,
        send: bool,
        at: f64,
        bytes: usize,
    ) -> transport::Result<u32> {
        // The id a new transfer gets (see `new_transfer`), known before the
        // channel is borrowed: one lookup per post.
        let next = self.free.last().copied();
        let next = next.unwrap_or(self.transfers.len() as u32);
        let channel = self.channels.entry(pair(src, dst)).or_default();
        if channel.pending.is_empty() || channel.sends == send {
            channel.sends = send;
            channel.pending.push_back(next);
            let posted = |mine: bool| if mine { at } else { f64::NAN };
            let id = self.new_transfer(Transfer {
                send_posted: posted(send),
                recv_posted: posted(!send),
                done: f64::INFINITY,
                bytes,
                src,
                unseen: 3,
            });
            debug_assert_eq!(id, next);
            return Ok(id);
        }
        let id = channel.pending.pop_front().expect("not empty");
        let first = self.transfers[id as usize].bytes;
        if first != bytes {
            let (expected_len, got_len) = if send { (first, bytes) } else { (bytes, first) };
            return Err(transport::Error::Mismatch {
                peer: src as usize,
                expected_tag: 0,
                expected_len,
                got_tag: 0,
                got_len,
            });
        }
        self.matched(id, src, dst, send, at, bytes);
        Ok(id)
    }

    /// Both ends of transfer `id` posted (the last by `src` if `send`, else
    /// `dst`): the model says when it lands, and the other end wakes then
    /// (the poster asks for its wake-up when it stops).
    fn matched(&mut self, id: u32, src: u32, dst: u32, send: bool, at: f64, bytes: usize) {
        let t = &mut self.transfers[id as usize];
        match send {
            true => t.send_posted = at,
            false => t.recv_posted = at,
        }
        let (send_posted, recv_posted) = (t.send_posted, t.recv_posted);
        let c = self.cluster;
        let (s, d) = (src as usize, dst as usize);
        let (hs, hd) = (c.host_of(s), c.host_of(d));
        let done = if hs == hd {
            let ready = send_posted.max(recv_posted);
            self.shm.carry(s, d, ready, bytes as f64, c.intra)
        } else {
            let link = Link {
                bandwidth: c.network_bandwidth(),
                latency: c.link.latency,
            };
            if c.rendezvous {
                // The receive's clear-to-send crosses the network first.
                let ready = send_posted.max(recv_posted + c.link.latency);
                self.nics.carry(hs, hd, ready, bytes as f64, link)
            } else {
                // Sent at once; waits in the receiver's socket buffer.
                (self.nics.carry(hs, hd, send_posted, bytes as f64, link)).max(recv_posted)
            }
        };
        self.transfers[id as usize].done = done;
        self.messages += 1;
        self.wakeups.wake(if send { dst } else { src }, done);
    }
}

impl Effects for RankEffects<'_, '_> {
    type Token = u32;

    fn post(&mut self, step: &Step, _: Option<Tag>, _: Option<usize>) -> transport::Result<u32> {
        self.now += self.world.cluster.overhead;
        let peer = step.peer() as u32;
        let (src, dst) = match step.is_send() {
            true => (self.me, peer),
            false => (peer, self.me),
        };
        self.world
            .post(src, dst, step.is_send(), self.now, step.span().len)
    }

    fn is_done(&mut self, _peer: Rank, token: u32) -> transport::Result<bool> {
        let t = &mut self.world.transfers[token as usize];
        if t.done > self.now {
            return Ok(false);
        }
        t.unseen &= !t.end(self.me);
        if t.unseen == 0 {
            self.world.free.push(token);
        }
        Ok(true)
    }

    fn progress(&mut self, _involved: &[bool]) -> transport::Result<bool> {
        Ok(false)
    }

    fn apply(&mut self, action: Action, span: Span, _from: Source) {
        let c = self.world.cluster;
        self.now += span.len as f64
            / match action {
                Action::Reduce { .. } => c.reduce_bandwidth,
                Action::Copy => c.intra.bandwidth,
            };
    }

    fn copy(&mut self, from: Span, _to: Span) {
        self.now += from.len as f64 / self.world.cluster.intra.bandwidth;
    }
}

fn pair(src: u32, dst: u32) -> u64 {
    (u64::from(src) << 32) | u64::from(dst)
}

/// Hashes a [`pair`] with one multiplication: keys are small distinct
/// integers, and SipHash's cost showed in profiles of large simulations.
#[derive(Default)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ (v >> 29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}
