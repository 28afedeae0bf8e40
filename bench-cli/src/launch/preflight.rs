//! What collbench checks before it spawns or allocates anything: every
//! argument, the rank count against the machine (like mpirun's "not enough
//! slots"), and the memory the run needs against the memory there is. A
//! bad request fails at once with a message that says what to change,
//! never with an allocation abort or thousands of processes.

use collectives::{Collective, Config};

use crate::cli::BenchArgs;

/// Ranks per core allowed without `--oversubscribe` (8 ranks on 2 cores is
/// this project's everyday test; thousands per core is a typo).
pub const RANKS_PER_CORE: usize = 32;

/// A rank's memory besides its two buffers: staging, shared memory (see
/// `collectives::shared_memory_per_rank`), the process.
fn baseline_bytes(ranks: usize, config: &Config) -> u64 {
    let staging = (config.chunk_bytes * config.depth) as u64;
    staging + collectives::shared_memory_per_rank(config, ranks) + (24 << 20)
}

/// Checks a local launch of `ranks` ranks before any is spawned.
pub fn check_launch(
    collective: Collective,
    args: &BenchArgs,
    ranks: usize,
    config: &Config,
) -> Result<(), String> {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    if ranks == 0 {
        return Err("-n must be at least 1".into());
    }
    if ranks > cores * RANKS_PER_CORE && !args.oversubscribe {
        return Err(format!(
            "-n {ranks} starts {ranks} processes on a machine with {cores} cores \
             (at most {} without --oversubscribe): use fewer ranks, a launcher across hosts, or --oversubscribe",
            cores * RANKS_PER_CORE
        ));
    }
    if let Some(limit) = process_limit() {
        if ranks as u64 > limit {
            return Err(format!(
                "-n {ranks} exceeds this user's process limit ({limit}, ulimit -u)"
            ));
        }
    }
    let per_rank = rank_bytes(collective, args, ranks, config)?;
    let need = per_rank.saturating_mul(ranks as u64);
    check_memory(need, &format!("{ranks} ranks x {}", human(per_rank)))
}

/// Checks that this rank's buffers fit before it allocates them (under a
/// launcher that did not check; other ranks' buffers may already be in
/// memory, so only this rank's own need is counted).
pub fn check_rank(
    collective: Collective,
    args: &BenchArgs,
    ranks: usize,
    config: &Config,
) -> Result<(), String> {
    let need = rank_bytes(collective, args, ranks, config)?;
    check_memory(need, "this rank")
}

/// One rank's memory for the largest size: two buffers (AllToAllv's
/// receive side may hold up to every rank's send) and the baseline.
fn rank_bytes(
    collective: Collective,
    args: &BenchArgs,
    ranks: usize,
    config: &Config,
) -> Result<u64, String> {
    let largest = *args.sizes()?.iter().max().ok_or("no sizes to run")?;
    let recv = match collective {
        Collective::AllToAllV => largest.saturating_mul(ranks as u64),
        _ => largest,
    };
    Ok(largest
        .saturating_add(recv)
        .saturating_add(baseline_bytes(ranks, config)))
}

fn check_memory(need: u64, what: &str) -> Result<(), String> {
    let Some(available) = available_memory() else {
        return Ok(());
    };
    if need > available {
        return Err(format!(
            "this run needs about {} of memory ({what}: two buffers of the largest size, plus staging and shared-memory lanes), \
             and {} is available: choose a smaller --size / -e or fewer ranks",
            human(need),
            human(available)
        ));
    }
    Ok(())
}

/// MemAvailable from /proc/meminfo.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// RLIMIT_NPROC, if any.
fn process_limit() -> Option<u64> {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nproc);
    limit.current
}

fn human(b: u64) -> String {
    crate::report::human_bytes(b)
}
