//! A job at scale on one machine: N ranks form a communicator, run checked
//! AllReduces, lose a rank (it SIGKILLs itself), and the survivors notice,
//! agree on who failed, shrink and run checked AllReduces again. Rank 0 of
//! the survivors prints each phase's time (slowest rank and median) and
//! what a rank holds: open descriptors, threads, memory.
//!
//!     cargo run --release -p collectives --example scale -- --ranks 512
//!
//! Over TCP by default (`COLL_TRANSPORT` chooses; shared memory is the
//! default of `collbench`). Starts the ranks itself (or runs as one rank
//! under a launcher). `--victim R` picks the rank that dies (default: a
//! rank in the middle).

use std::time::{Duration, Instant};

use collectives::bootstrap::{launch, under_launcher};
use collectives::{Communicator, ReduceOp};

/// Checked AllReduces per phase.
const CALLS: usize = 20;

fn main() {
    let (mut ranks, mut victim) = (512, None);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut number = || args.next().and_then(|n| n.parse().ok());
        match a.as_str() {
            "--ranks" => ranks = number().expect("--ranks N"),
            "--victim" => victim = Some(number().expect("--victim R")),
            other => panic!("unknown flag {other} (--ranks N, --victim R)"),
        }
    }
    if !under_launcher() {
        // The parent chooses the victim, to know whose death is expected.
        let victim = victim.unwrap_or(ranks / 2 + 1).min(ranks - 1);
        let transport = std::env::var("COLL_TRANSPORT").unwrap_or_else(|_| "tcp".into());
        let job = launch::Launch {
            nranks: ranks,
            program: std::env::current_exe().unwrap(),
            args: ["--ranks".into(), ranks.to_string().into()]
                .into_iter()
                .chain(["--victim".into(), victim.to_string().into()])
                .collect(),
            // Every survivor dumps its flight record when the death fails
            // its call, and says so at WARN: quiet unless asked.
            env: vec![
                ("COLL_TRANSPORT".into(), transport),
                (
                    "COLL_DEBUG".into(),
                    std::env::var("COLL_DEBUG").unwrap_or("error".into()),
                ),
            ],
            timeout: Duration::from_secs(120),
            bind: launch::Bind::None,
        };
        let outcome = launch::run(&job).expect("launching the ranks");
        // The victim's death is the point: only the others must succeed.
        let expected = format!("rank {victim} was killed by signal 9 (SIGKILL)");
        let others_failed = outcome.failures.iter().any(|f| *f != expected);
        std::process::exit(others_failed as i32);
    }
    if let Err(e) = run(victim) {
        eprintln!("{e}");
        std::process::exit(1);
    }
}

/// Seconds of each phase on this rank, in order.
const PHASES: [&str; 7] = [
    "form the communicator",
    "first AllReduce (connects)",
    "AllReduce, each",
    "notice the death",
    "agree on the failed",
    "shrink",
    "AllReduce after, each",
];

fn run(victim: Option<usize>) -> Result<(), String> {
    let e = |e: collectives::Error| e.to_string();
    let t = Instant::now();
    let mut comm = Communicator::from_env().map_err(e)?;
    let mut secs = vec![t.elapsed().as_secs_f64()];
    let (rank, size) = (comm.rank(), comm.size());
    let victim = victim.unwrap_or(size / 2 + 1).min(size - 1);
    let t = Instant::now();
    checked_all_reduce(&mut comm, rank, size, 1)?;
    secs.push(t.elapsed().as_secs_f64());
    let t = Instant::now();
    for _ in 0..CALLS {
        checked_all_reduce(&mut comm, rank, size, 1)?;
    }
    secs.push(t.elapsed().as_secs_f64() / CALLS as f64);
    let held = Held::now();
    comm.barrier().map_err(e)?;
    if rank == victim {
        let me = rustix::process::getpid();
        rustix::process::kill_process(me, rustix::process::Signal::KILL).unwrap();
    }
    let t = Instant::now();
    let mut noticed = false;
    for _ in 0..CALLS {
        // A failed call is the notice; a wrong sum is not.
        match sum_of_ranks(&mut comm, rank, 1) {
            Ok(x) => check(x, rank, size, 1)?,
            Err(_) => {
                noticed = true;
                break;
            }
        }
    }
    if !noticed {
        return Err(format!(
            "rank {rank}: rank {victim} died and no call failed"
        ));
    }
    secs.push(t.elapsed().as_secs_f64());
    let t = Instant::now();
    let failed = comm.failed_ranks().map_err(e)?;
    secs.push(t.elapsed().as_secs_f64());
    if failed != [victim] {
        return Err(format!(
            "rank {rank}: agreed {failed:?} failed, not [{victim}]"
        ));
    }
    let t = Instant::now();
    let mut comm = comm.shrink(&failed, false).map_err(e)?;
    secs.push(t.elapsed().as_secs_f64());
    let (new_rank, new_size) = (comm.rank(), comm.size());
    let t = Instant::now();
    for _ in 0..CALLS {
        checked_all_reduce(&mut comm, new_rank, new_size, 2)?;
    }
    secs.push(t.elapsed().as_secs_f64() / CALLS as f64);
    report(&mut comm, size, victim, &secs, held).map_err(e)
}

/// An AllReduce of each rank's `rank + 1` (times `scale`), checked.
fn checked_all_reduce(
    comm: &mut Communicator,
    rank: usize,
    size: usize,
    scale: u64,
) -> Result<(), String> {
    let x = sum_of_ranks(comm, rank, scale).map_err(|e| e.to_string())?;
    check(x, rank, size, scale)
}

/// An AllReduce of (rank + 1) * `scale` over the communicator.
fn sum_of_ranks(comm: &mut Communicator, rank: usize, scale: u64) -> collectives::Result<[u64; 3]> {
    let mut x = [(rank as u64 + 1) * scale; 3];
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
    Ok(x)
}

/// Whether `x` is the sum of (rank + 1) * `scale` over `size` ranks.
fn check(x: [u64; 3], rank: usize, size: usize, scale: u64) -> Result<(), String> {
    let want = scale * (size * (size + 1) / 2) as u64;
    match x == [want; 3] {
        true => Ok(()),
        false => Err(format!("rank {rank}: AllReduce gave {x:?}, not {want}")),
    }
}

/// What this process holds, from /proc.
#[derive(Clone, Copy)]
struct Held {
    fds: f64,
    threads: f64,
    rss_mib: f64,
}

impl Held {
    fn now() -> Self {
        let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count()) as f64;
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let field = |name: &str| {
            (status.lines())
                .find_map(|l| {
                    l.strip_prefix(name)?
                        .split_whitespace()
                        .next()?
                        .parse()
                        .ok()
                })
                .unwrap_or(0.0)
        };
        Held {
            fds,
            threads: field("Threads:"),
            rss_mib: field("VmRSS:") / 1024.0,
        }
    }
}

/// Rank 0 prints every figure's maximum and median over the survivors.
fn report(
    comm: &mut Communicator,
    size: usize,
    victim: usize,
    secs: &[f64],
    held: Held,
) -> collectives::Result<()> {
    let mine: Vec<f64> = (secs.iter().copied())
        .chain([held.fds, held.threads, held.rss_mib])
        .collect();
    let mut all = vec![0.0; mine.len() * comm.size()];
    comm.all_gather(&mine, &mut all)?;
    if comm.rank() != 0 {
        return Ok(());
    }
    let column = |i: usize| {
        let mut v: Vec<f64> = all.chunks(mine.len()).map(|c| c[i]).collect();
        v.sort_by(f64::total_cmp);
        (v[v.len() - 1], v[v.len() / 2])
    };
    let transport = comm.transport_summary();
    println!(
        "{size} ranks over {transport}; rank {victim} dies; over the {} survivors:",
        comm.size()
    );
    println!("{:<30} {:>12} {:>12}", "phase", "slowest (s)", "median (s)");
    for (i, name) in PHASES.iter().enumerate() {
        let (max, median) = column(i);
        println!("{name:<30} {max:>12.6} {median:>12.6}");
    }
    println!(
        "{:<30} {:>12} {:>12}",
        "held before the death", "most", "median"
    );
    for (i, name) in ["open descriptors", "threads", "resident memory (MiB)"]
        .iter()
        .enumerate()
    {
        let (max, median) = column(PHASES.len() + i);
        println!("{name:<30} {max:>12.1} {median:>12.1}");
    }
    Ok(())
}
