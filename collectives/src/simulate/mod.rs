//! Predicting a collective's time on a cluster we do not have: every rank's
//! schedule, built by the registered algorithm exactly as a communicator
//! builds it, run by the one executor (its windows, staging slots and
//! `after` edges) on a virtual clock, with what a message, a reduction and
//! a copy cost given by a model of the cluster ([`Cluster`]; its equations
//! are in `model.rs`). Only time is simulated: no byte is moved.
//!
//! `collbench simulate` prints the predictions; the selector asks
//! [`fastest`] for settings its measured profile does not cover.

mod engine;
mod model;

use std::time::{Duration, Instant};

pub use engine::Status;
pub use model::{Cluster, Link};

use crate::algo::{self, Algorithm, Layout};
use crate::executor::{Execution, Windows};
use crate::schedule::Schedule;
use crate::{Collective, DataType};

/// The most schedule steps a simulation holds (every rank's whole schedule
/// is in memory, about [`BYTES_PER_STEP`] each with its executor state): a
/// 4096-rank ring AllReduce has 67 million.
pub const MAX_STEPS: usize = 100_000_000;
const BYTES_PER_STEP: usize = 180;

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
    let mut count = bytes / dtype.size();
    if collective.blocks() {
        count = count / n * n;
    }
    let hosts = cluster.host_ranks();
    let steps = |rank| {
        let mut sched = Schedule::default();
        (algorithm.build)(
            &layout(collective, rank, n, count, dtype, pipeline, &hosts),
            &mut sched,
        );
        sched.len()
    };
    // Every rank's schedule is held at once: refuse what would not fit.
    let estimate = steps(0).max(steps(n - 1)).saturating_mul(n);
    if estimate > MAX_STEPS {
        return Err(format!(
            "{} {} on {n} ranks at {bytes} B would hold about {estimate} schedule steps \
             (over {MAX_STEPS}, ~{} GB): use a larger --chunk or fewer ranks",
            collective,
            algorithm.name,
            (MAX_STEPS * BYTES_PER_STEP) >> 30
        ));
    }
    let mut members: Vec<engine::Member> = (0..n)
        .map(|rank| {
            let layout = layout(collective, rank, n, count, dtype, pipeline, &hosts);
            let mut sched = Schedule::default();
            (algorithm.build)(&layout, &mut sched);
            engine::Member {
                sched,
                exec: Execution::default(),
                now: 0.0,
                finished: None,
            }
        })
        .collect();
    let windows = Windows {
        sends: crate::transfers::SEND_WINDOW.max(pipeline.depth),
        recvs: pipeline.depth,
        slots: pipeline.depth,
    };
    let out = engine::run(cluster, &mut members, windows, report)?;
    Ok(Prediction {
        algorithm: algorithm.name,
        bytes: count * dtype.size(),
        seconds: out.seconds,
        messages: out.messages,
        events: out.events,
        wall: started.elapsed(),
    })
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

/// The algorithm the built-in thresholds pick for this call on `cluster`,
/// and why.
pub fn built_in_choice(
    cluster: &Cluster,
    collective: Collective,
    bytes: usize,
) -> (&'static Algorithm, &'static str) {
    algo::select(collective, bytes, cluster.ranks, &cluster.host_ranks())
}

/// Every algorithm of `collective` that runs as itself on `cluster`, each
/// simulated; the fastest first.
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
        .map(|a| simulate(cluster, a, bytes, dtype, pipeline))
        .collect::<Result<Vec<_>, _>>()?;
    all.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
    Ok(all)
}

#[cfg(test)]
mod tests;
