//! Predicting a collective's time on a cluster we do not have: every rank's
//! schedule, built by the registered algorithm exactly as a communicator
//! builds it, run by the one executor (its windows, staging slots and
//! `after` edges) on a virtual clock, with what a message, a reduction and
//! a copy cost given by a model of the cluster ([`Cluster`]; its equations
//! are in `model.rs`). Only time is simulated: no byte is moved.
//!
//! `collbench simulate` prints the predictions; the selector asks
//! [`fastest`] for settings its measured profile does not cover.
//!
//! Owns: the virtual clock and the cluster model. May not touch: transports
//! or the communicator; it runs the real algorithms and executor only.

mod agenda;
pub mod control;
mod engine;
mod model;

use std::time::{Duration, Instant};

pub use engine::Status;
pub use model::{Cluster, Link};

use crate::algo::schedule::Schedule;
use crate::algo::{self, Algorithm, Layout, Topology};
use crate::exec::executor::{Execution, Windows};
use crate::{Collective, DataType};

/// The most schedule steps a simulation holds (every rank's whole schedule
/// is in memory, about `BYTES_PER_STEP` each with its executor state: a
/// 32-byte step, its 8-byte state, its place in its queue): a 4096-rank
/// ring AllReduce has 67 million (2.9 GB).
pub const MAX_STEPS: usize = 100_000_000;
const BYTES_PER_STEP: usize = 46;
/// The most steps the selector simulates to choose (about 50 MB, under a
/// second, once per collective and power-of-two size): at 4096 ranks that
/// covers Rabenseifner, the trees and hierarchical up to a few MiB, not the
/// ring or direct, which the table then stands in for.
pub const CHOICE_MAX_STEPS: usize = 1 << 20;
/// And the most steps times queues per rank: the executor looks at each of
/// a rank's queues (one per peer and direction) whenever it runs, so direct
/// on 512 ranks (1022 queues) takes 8 s to simulate at 1 MiB where the ring
/// (2 queues) with twice the steps takes 0.3 s.
pub const CHOICE_MAX_WORK: usize = 16 << 20;

/// How a call is cut and pipelined: the communicator's `COLL_CHUNK` and
/// `COLL_DEPTH`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pipeline {
    pub chunk: usize,
    pub depth: usize,
}

impl Default for Pipeline {
    fn default() -> Self {
        let c = crate::Config::default();
        Pipeline {
            chunk: c.chunk_bytes,
            depth: c.depth,
        }
    }
}

/// One simulated call.
#[derive(Clone, Debug)]
pub struct Prediction {
    pub algorithm: &'static str,
    /// Bytes of the call (per rank, as collbench counts them).
    pub bytes: usize,
    /// Until the last rank finished.
    pub seconds: f64,
    pub messages: u64,
    /// Times a rank was woken to step its executor.
    pub events: u64,
    /// How long the simulation took.
    pub wall: Duration,
}

/// Simulates one `algorithm` call of `bytes` per rank (rounded down to whole
/// elements, and to whole blocks for collectives that cut the buffer into
/// one block per rank) on `cluster`, out of place, root 0.
pub fn simulate(
    cluster: &Cluster,
    algorithm: &'static Algorithm,
    bytes: usize,
    dtype: DataType,
    pipeline: Pipeline,
) -> Result<Prediction, String> {
    simulate_reporting(cluster, algorithm, bytes, dtype, pipeline, &mut |_| {})
}

/// [`simulate`], calling `report` now and then (every million rank
/// wake-ups) during long runs.
pub fn simulate_reporting(
    cluster: &Cluster,
    algorithm: &'static Algorithm,
    bytes: usize,
    dtype: DataType,
    pipeline: Pipeline,
    report: &mut dyn FnMut(Status),
) -> Result<Prediction, String> {
    cluster.validate()?;
    let collective = algorithm.collective;
    if collective == Collective::AllToAllV {
        return Err("alltoallv is not simulated (its blocks depend on the caller's counts)".into());
    }
    if pipeline.depth == 0 || pipeline.chunk < dtype.size() {
        return Err(
            "the pipeline needs a depth of 1 or more and a chunk of one element or more".into(),
        );
    }
    let started = Instant::now();
    let n = cluster.ranks;
    let count = elements(cluster, collective, bytes, dtype);
    let hosts = cluster.host_ranks();
    // Every rank's schedule is held at once: refuse what would not fit.
    let estimate = footprint(cluster, algorithm, bytes, dtype, pipeline).steps;
    if estimate > MAX_STEPS {
        return Err(format!(
            "{} {} on {n} ranks at {bytes} B would hold about {estimate} schedule steps \
             (over {MAX_STEPS}, ~{} GB): use a larger --chunk or fewer ranks",
            collective,
            algorithm.name,
            (MAX_STEPS * BYTES_PER_STEP) >> 30
        ));
    }
    let windows = Windows {
        sends: crate::exec::transfers::SEND_WINDOW.max(pipeline.depth),
        recvs: pipeline.depth,
        slots: pipeline.depth,
    };
    let mut members = build_all(n, |rank| {
        let layout = layout(collective, rank, n, count, dtype, pipeline, &hosts);
        let mut sched = Schedule::default();
        (algorithm.build)(&layout, &mut sched);
        let mut exec = Execution::default();
        exec.start(&sched, n, windows);
        exec.trim();
        engine::Member {
            sched,
            exec,
            now: 0.0,
            finished: None,
        }
    });
    let out = engine::run(cluster, &mut members, report)?;
    Ok(Prediction {
        algorithm: algorithm.name,
        bytes: count * dtype.size(),
        seconds: out.seconds,
        messages: out.messages,
        events: out.events,
        wall: started.elapsed(),
    })
}

/// `build(rank)` for every rank of `n`, on every core for large `n` (the
/// schedules of thousands of ranks take seconds to build, most of it
/// the kernel clearing their pages).
fn build_all<T: Send>(n: usize, build: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let threads = std::thread::available_parallelism().map_or(1, |c| c.get());
    if n < 256 || threads == 1 {
        return (0..n).map(build).collect();
    }
    let per = n.div_ceil(threads);
    std::thread::scope(|s| {
        let parts: Vec<_> = (0..n)
            .step_by(per)
            .map(|first| {
                let build = &build;
                s.spawn(move || (first..n.min(first + per)).map(build).collect::<Vec<_>>())
            })
            .collect();
        (parts.into_iter())
            .flat_map(|p| p.join().expect("a schedule build panicked"))
            .collect()
    })
}

/// The elements of a call of `bytes` per rank: whole elements, and whole
/// blocks for collectives that cut the buffer into one block per rank.
fn elements(cluster: &Cluster, collective: Collective, bytes: usize, dtype: DataType) -> usize {
    let count = bytes / dtype.size();
    match collective.blocks() {
        true => count / cluster.ranks * cluster.ranks,
        false => count,
    }
}

/// How large a simulation is, from the first and the last rank's schedules
/// (the larger).
#[derive(Clone, Copy, Debug)]
pub struct Footprint {
    /// Steps of every rank together.
    pub steps: usize,
    /// Queues (peers and directions) of one rank.
    pub queues: usize,
}

impl Footprint {
    /// What a simulation costs beyond its steps: the executor looks at each
    /// of a rank's queues whenever the rank runs.
    pub fn work(&self) -> usize {
        self.steps.saturating_mul(self.queues)
    }
}

pub fn footprint(
    cluster: &Cluster,
    algorithm: &'static Algorithm,
    bytes: usize,
    dtype: DataType,
    pipeline: Pipeline,
) -> Footprint {
    let (n, hosts) = (cluster.ranks, cluster.host_ranks());
    let count = elements(cluster, algorithm.collective, bytes, dtype);
    let of = |rank| {
        let mut sched = Schedule::default();
        let l = layout(
            algorithm.collective,
            rank,
            n,
            count,
            dtype,
            pipeline,
            &hosts,
        );
        (algorithm.build)(&l, &mut sched);
        let mut queues: Vec<_> = (sched.steps.iter())
            .filter(|s| !matches!(s.kind, crate::algo::schedule::Kind::Local(..)))
            .map(|s| (s.peer(), s.is_send()))
            .collect();
        queues.sort_unstable();
        queues.dedup();
        (sched.len(), queues.len())
    };
    let ((s0, q0), (s1, q1)) = (of(0), of(n - 1));
    Footprint {
        steps: s0.max(s1).saturating_mul(n),
        queues: q0.max(q1),
    }
}

fn layout<'h>(
    collective: Collective,
    rank: usize,
    size: usize,
    count: usize,
    dtype: DataType,
    pipeline: Pipeline,
    hosts: &'h [Vec<usize>],
) -> Layout<'h> {
    Layout::of_call(
        collective,
        dtype,
        rank,
        size,
        count,
        pipeline.chunk,
        false,
        hosts,
    )
}

/// What a communicator of `ranks` ranks, numbered host by host with
/// `per_host` on each, without a measured profile, picks for a call of
/// `bytes`, and why: [`choice`] on [`Cluster::roce`] of that shape (over TCP
/// without the verbs rendezvous) at the next power of two of `bytes`, so
/// that a size's neighbours share one simulation.
pub fn unprofiled_choice(
    ranks: usize,
    per_host: usize,
    rendezvous: bool,
    collective: Collective,
    bytes: usize,
    pipeline: Pipeline,
) -> (&'static Algorithm, String) {
    let cluster = Cluster {
        rendezvous,
        ..Cluster::roce(ranks, per_host)
    };
    let size = bytes.next_power_of_two();
    let (algo, why) = choice(&cluster, collective, size, pipeline);
    match size == bytes {
        true => (algo, why),
        false => (algo, format!("{why} (at {size} B)")),
    }
}

/// What a communicator without a measured profile picks for a call of
/// `bytes` on `cluster`, and why: from [`algo::SCALE_MIN_RANKS`] ranks on
/// (beyond anything measured here), the AllReduce or AllToAll algorithm the
/// simulator predicts fastest, among those whose simulation stays within
/// [`CHOICE_MAX_STEPS`] and at least two of them; else the built-in
/// thresholds. Deterministic: every rank picks the same.
pub fn choice(
    cluster: &Cluster,
    collective: Collective,
    bytes: usize,
    pipeline: Pipeline,
) -> (&'static Algorithm, String) {
    let (table, why) = algo::select(collective, bytes, &Topology::new(cluster.host_ranks()));
    let modelled = matches!(collective, Collective::AllReduce | Collective::AllToAll);
    if cluster.ranks < algo::SCALE_MIN_RANKS || !modelled {
        return (table, why.to_string());
    }
    // Every rank sends most of its bytes in chunks: no schedule is smaller,
    // so none would fit (and building one to count would cost the memory).
    if bytes.div_ceil(pipeline.chunk).saturating_mul(cluster.ranks) > CHOICE_MAX_STEPS {
        return (table, format!("{why} (too large to simulate here)"));
    }
    match fastest(cluster, collective, bytes, DataType::F32, pipeline) {
        Ok(p) if p.len() >= 2 => {
            let a = algo::find(collective, p[0].algorithm).expect("registered");
            let us = |p: &Prediction| p.seconds * 1e6;
            let why = format!(
                "the simulator's pick on {} ranks, {} per host: {:.1} us predicted, {} {:.1} us",
                cluster.ranks,
                cluster.ranks_per_host,
                us(&p[0]),
                p[1].algorithm,
                us(&p[1])
            );
            (a, why)
        }
        _ => (table, format!("{why} (too large to simulate here)")),
    }
}

/// The algorithms of `collective` that run as themselves on `cluster` and
/// whose simulation stays within [`CHOICE_MAX_STEPS`] and
/// [`CHOICE_MAX_WORK`], each simulated; the fastest first.
pub fn fastest(
    cluster: &Cluster,
    collective: Collective,
    bytes: usize,
    dtype: DataType,
    pipeline: Pipeline,
) -> Result<Vec<Prediction>, String> {
    let hosts = cluster.host_ranks();
    let mut all = (algo::ALGORITHMS.iter())
        .filter(|a| a.collective == collective && algo::fits(a.name, &hosts))
        .filter(|a| {
            let f = footprint(cluster, a, bytes, dtype, pipeline);
            f.steps <= CHOICE_MAX_STEPS && f.work() <= CHOICE_MAX_WORK
        })
        .map(|a| simulate(cluster, a, bytes, dtype, pipeline))
        .collect::<Result<Vec<_>, _>>()?;
    all.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
    Ok(all)
}

#[cfg(test)]
mod tests;
