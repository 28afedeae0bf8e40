//! collbench: measures collectives the way nccl-tests does. With `-n N` it
//! starts N ranks of itself on this host; under a launcher (mpirun,
//! torchrun-style variables) each process is one rank.

mod bench;
mod cli;
mod data;
mod plot;
mod preflight;
mod report;
mod simulate;
mod skew;
mod trace;
mod tune;

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use collectives::algo::ALGORITHMS;
use collectives::bootstrap::{launch, Bootstrap, LAUNCHER_VAR};
use collectives::{Collective, Communicator, Config};

use bench::{human_bytes, Bench};
use cli::{BenchArgs, Cli, Command};

/// collbench's own default timeout; the library's (300 s) suits training jobs
/// whose ranks may be busy elsewhere, a benchmark should fail faster.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (collective, args) = match cli.command {
        Command::Tune(t) => {
            collectives::log::init();
            let result = match t.bench.nranks {
                Some(n) if std::env::var_os(LAUNCHER_VAR).is_none() && !under_launcher() => {
                    launch_local(Collective::AllReduce, n, &t.bench)
                }
                _ => tune_rank(&t).map(|()| 0),
            };
            return exit(result);
        }
        Command::Allreduce(a) => (Collective::AllReduce, a),
        Command::Alltoall(a) => (Collective::AllToAll, a),
        Command::Alltoallv(a) => (Collective::AllToAllV, a),
        Command::Reducescatter(a) => (Collective::ReduceScatter, a),
        Command::Allgather(a) => (Collective::AllGather, a),
        Command::Broadcast(a) => (Collective::Broadcast, a),
        Command::Reduce(a) => (Collective::Reduce, a),
        Command::Trace { dir } => {
            return match trace::run(&dir) {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => exit(Err(e)),
            };
        }
        Command::Plot { files, out } => {
            return match plot::run(&files, &out) {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => exit(Err(e)),
            };
        }
        Command::Simulate(a) => {
            simulate::with_huge_pages(&a);
            return match simulate::run(&a) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => exit(Err(e)),
            };
        }
        Command::Algorithms => {
            for a in ALGORITHMS {
                println!("{:<14} {:<10} {}", a.collective.name(), a.name, a.summary);
            }
            return ExitCode::SUCCESS;
        }
    };
    collectives::log::init();
    let result = match args.nranks {
        Some(n) if std::env::var_os(LAUNCHER_VAR).is_none() && !under_launcher() => {
            launch_local(collective, n, &args)
        }
        _ => run_rank(collective, &args).map(|clean| if clean { 0 } else { WRONG_VALUES }),
    };
    exit(result)
}

fn exit(result: Result<u8, String>) -> ExitCode {
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            collectives::log::eprint_line(&format!("collbench: {e}"));
            ExitCode::from(FAILED)
        }
    }
}

/// Exit status when some result was wrong.
const WRONG_VALUES: u8 = 1;
/// Exit status when a rank failed.
const FAILED: u8 = 2;

/// Whether a launcher already made this process one rank of a job.
fn under_launcher() -> bool {
    ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// Starts `n` ranks of this very command and waits for them; the exit status
/// is the ranks' (1: wrong values only, 2: a rank failed). Every argument,
/// the rank count and the memory are checked before anything starts.
fn launch_local(collective: Collective, n: usize, args: &BenchArgs) -> Result<u8, String> {
    let config = config(collective, args)?;
    check_args(collective, args, n)?;
    preflight::check_launch(collective, args, n, &config)?;
    let job = launch::Launch {
        nranks: n,
        program: std::env::current_exe()
            .map_err(|e| format!("cannot find my own executable: {e}"))?,
        args: std::env::args_os().skip(1).collect(),
        env: Vec::new(),
        timeout: timeout(args)?,
        bind: match &args.bind {
            Some(b) => launch::Bind::parse(b)?,
            None => launch::Bind::from_env()?,
        },
    };
    let outcome = launch::run(&job)?;
    for f in &outcome.failures {
        collectives::log::eprint_line(&format!("collbench: {f}"));
    }
    if let Some(path) = std::env::var("COLL_TRACE")
        .ok()
        .filter(|p| !p.contains("{rank}") && !p.is_empty())
    {
        merge_traces(&path, n)?;
    }
    Ok(match outcome.worst_status {
        0 => 0,
        WRONG_VALUES => WRONG_VALUES,
        _ => FAILED,
    })
}

fn timeout(args: &BenchArgs) -> Result<Duration, String> {
    Ok(match args.timeout {
        Some(t) => t,
        None if std::env::var("COLL_TIMEOUT").is_ok() => Config::from_env()?.timeout,
        None => DEFAULT_TIMEOUT,
    })
}

/// Merges the ranks' Chrome traces (`<path>.rank<R>.json`) into `<path>`:
/// one file, one process per rank.
fn merge_traces(path: &str, n: usize) -> Result<(), String> {
    let mut events = Vec::new();
    for rank in 0..n {
        let part = format!("{path}.rank{rank}.json");
        let Ok(text) = std::fs::read_to_string(&part) else {
            continue; // a rank that failed may have written none
        };
        let doc: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{part}: {e}"))?;
        if let Some(list) = doc["traceEvents"].as_array() {
            events.extend(list.iter().cloned());
        }
        let _ = std::fs::remove_file(&part);
    }
    let doc = serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"});
    std::fs::write(path, serde_json::to_vec(&doc).map_err(|e| e.to_string())?)
        .map_err(|e| format!("COLL_TRACE: cannot write {path}: {e}"))
}

/// The arguments the library would otherwise refuse only in every rank.
fn check_args(collective: Collective, args: &BenchArgs, n: usize) -> Result<(), String> {
    args.sizes()?;
    if let Some(name) = &args.algo {
        if collectives::algo::find(collective, &name.to_lowercase()).is_none() {
            return Err(format!(
                "no {collective} algorithm named '{name}' (available: {})",
                collectives::algo::names(collective).join(", ")
            ));
        }
    }
    if collective.rooted() && args.root >= n {
        return Err(format!(
            "{collective}: root {} is not a rank of the {n}",
            args.root
        ));
    }
    Ok(())
}

/// The library settings: environment first, flags over it.
fn config(collective: Collective, args: &BenchArgs) -> Result<Config, String> {
    let mut c = Config::from_env()?;
    c.timeout = timeout(args)?;
    if let Some(t) = &args.transport {
        c.transport = t.clone();
    }
    if let Some(a) = &args.algo {
        // --algo names the benchmarked collective's algorithm only.
        c.algo
            .push((collective.name().to_string(), a.to_lowercase()));
    }
    if let Some(chunk) = args.chunk {
        c.chunk_bytes = chunk as usize;
    }
    if let Some(d) = args.depth {
        c.depth = d;
    }
    c.validate()?;
    Ok(c)
}

/// This process is one rank of `collbench tune`.
fn tune_rank(t: &cli::TuneArgs) -> Result<(), String> {
    let sizes = t.sizes.clone().unwrap_or_else(|| {
        ["8", "1K", "32K", "256K", "1M", "4M", "16M"]
            .iter()
            .map(|s| collectives::parse_size(s).expect("valid"))
            .collect()
    });
    let boot = Bootstrap::from_env()?;
    // The algorithms are forced one by one; the profile must not decide.
    let mut comm = Communicator::init(boot, config(Collective::Barrier, &t.bench)?)
        .map_err(|e| e.to_string())?;
    tune::run(&mut comm, &t.bench, &sizes, t.out.clone())
}

/// This process is one rank: join the job, sweep, report (rank 0).
fn run_rank(collective: Collective, args: &BenchArgs) -> Result<bool, String> {
    let sizes = args.sizes()?;
    let boot = Bootstrap::from_env()?;
    if let Some(n) = args.nranks.filter(|n| *n != boot.size) {
        return Err(format!(
            "-n {n} but the launcher started {} ranks ({})",
            boot.size, boot.source
        ));
    }
    let launcher = boot.source;
    let mut comm =
        Communicator::init(boot, config(collective, args)?).map_err(|e| e.to_string())?;
    preflight::check_rank(collective, args, comm.size(), comm.config())?;
    let algo = match collectives::select::forced_algo(comm.config(), collective) {
        Some(_) => {
            comm.algorithm(collective, 0)
                .map_err(|e| e.to_string())?
                .name
        }
        None => "selected by size",
    };
    let max_bytes = *sizes.iter().max().unwrap();
    let mut bench = Bench::new(&mut comm, args, collective, max_bytes)?;
    let rank0 = bench.comm.rank() == 0;
    let json_to_stdout = args.json.as_deref().is_some_and(|p| p.as_os_str() == "-");
    let mut out: Box<dyn Write> = match (rank0, json_to_stdout) {
        (false, _) => Box::new(std::io::sink()),
        (true, false) => Box::new(std::io::stdout()),
        (true, true) => Box::new(std::io::stderr()),
    };
    let io = |e: std::io::Error| e.to_string();
    if rank0 {
        print_preamble(&mut *out, &bench, launcher, algo, sizes[0]).map_err(io)?;
        report::header(&mut *out).map_err(io)?;
    }
    bench::settle(bench.comm, args.settle).map_err(|e| e.to_string())?;
    let mut rows = Vec::with_capacity(sizes.len());
    let started = std::time::Instant::now();
    let rank = bench.comm.rank();
    for (k, &size) in sizes.iter().enumerate() {
        // On a terminal, a bar on stderr between the rows (cleared before each).
        bench.sweep = (k, sizes.len());
        bench::show_bar(rank, k, sizes.len(), started);
        let row = bench.row(size).map_err(|e| e.to_string())?;
        bench::show_bar(rank, sizes.len(), sizes.len(), started);
        report::row(&mut *out, &row).map_err(io)?;
        out.flush().map_err(io)?;
        rows.push(row);
    }
    let mut peak = [bench::peak_rss()];
    bench
        .comm
        .all_reduce_in_place(&mut peak, collectives::ReduceOp::Max)
        .map_err(|e| e.to_string())?;
    let summary = report::Summary::of(&rows, peak[0]);
    if rank0 {
        report::footer(&mut *out, &summary, max_bytes).map_err(io)?;
        if let Some(path) = &args.json {
            let config = bench.comm.config();
            let doc = report::Document {
                collective: collective.name(),
                nranks: bench.comm.size(),
                launcher,
                transport: &bench.comm.transport_summary(),
                algorithm: algo,
                chunk_bytes: config.chunk_bytes,
                depth: config.depth,
                check: args.check == 1,
                shared_buffers: args.shared_buffers(),
                rows: &rows,
                summary: &summary,
                stats: bench.comm.stats(),
            };
            let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
            if json_to_stdout {
                println!("{text}");
            } else {
                std::fs::write(path, text + "\n")
                    .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            }
        }
    }
    Ok(summary.wrong == 0)
}

fn print_preamble(
    out: &mut dyn Write,
    bench: &Bench,
    launcher: &str,
    algo: &str,
    smallest: u64,
) -> std::io::Result<()> {
    let (comm, args) = (&*bench.comm, bench.args);
    let c = comm.config();
    // Large reductions over shared memory stage smaller chunks, fewer at a time.
    let large = match comm.pipeline(bench.collective, usize::MAX) {
        (chunk, staged) if (chunk, staged) != comm.pipeline(bench.collective, 0) => {
            format!(
                " (large calls: {}, {staged} staged)",
                human_bytes(chunk as u64)
            )
        }
        _ => String::new(),
    };
    writeln!(
        out,
        "# collbench {}: {} ranks ({launcher}), transport {}, algorithm {algo}, chunk {} x {} in flight{large}, timeout {}s",
        bench.collective.name(),
        comm.size(),
        comm.transport_summary(),
        human_bytes(c.chunk_bytes as u64),
        c.depth,
        c.timeout.as_secs_f64()
    )?;
    let (iters, warmup) = args.iterations(smallest);
    writeln!(
        out,
        "# datatype {}{}, check {}, iterations {iters}{} (warmup {warmup}) at {}, after {} ms of barriers{}",
        bench::describe_dtype(args.dtype),
        match bench.collective.rooted() {
            true => format!(", root {}", args.root),
            false => String::new(),
        },
        if args.check == 1 { "on" } else { "off" },
        match args.paces(smallest) {
            true => format!(" or more, to fill {} ms", cli::PACED_SPAN * 1e3),
            false => String::new(),
        },
        human_bytes(smallest),
        args.settle,
        match args.fresh {
            true => "; inputs rewritten before each call (--fresh), timed with it",
            false => "",
        },
    )?;
    if args.shared_buffers() {
        writeln!(
            out,
            "# buffers: SharedBuffers (--shared-buffers): peers on the host map them and read with memcpy"
        )?;
    }
    for ranks in comm.hosts() {
        writeln!(out, "#   host {}: ranks {ranks:?}", comm.hostname(ranks[0]))?;
    }
    Ok(())
}
