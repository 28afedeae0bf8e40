//! `collbench simulate`: predicted time, algbw and busbw per size and
//! algorithm, in collbench's table layout, from the library's simulator.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use collectives::algo::{self, Algorithm};
use collectives::simulate::{self, Cluster, Link, Pipeline, Prediction, Status};
use collectives::Collective;
use serde::Serialize;

use crate::cli::SimArgs;
use crate::report;

#[derive(Serialize)]
struct Row {
    size: usize,
    count: usize,
    algorithm: &'static str,
    time_us: f64,
    algbw_gbs: f64,
    busbw_gbs: f64,
    /// The built-in selector's pick.
    selected: bool,
    fastest: bool,
    messages: u64,
    events: u64,
    wall_s: f64,
}

#[derive(Serialize)]
struct Report {
    collective: &'static str,
    cluster: String,
    ranks: usize,
    ranks_per_host: usize,
    chunk: usize,
    depth: usize,
    dtype: &'static str,
    results: Vec<Row>,
}

/// From this many ranks on, a simulation holds gigabytes of schedules and
/// its time goes to cache and TLB misses: glibc's malloc then asks for
/// transparent huge pages (4096-rank ring AllReduce of 1 GiB: 40 s without,
/// 29 s with before the engine loaded ranks ahead; now 22 s without, 20 s
/// with, medians of 3).
const HUGE_PAGES_FROM_RANKS: usize = 1024;

/// With every algorithm asked for, those whose steps times queues per rank
/// exceed this are left out: the executor looks at each of a rank's queues
/// whenever it runs, so direct on 4096 ranks (8190 queues) runs about 15,000
/// wake-ups a second and would take half an hour at 8 B (direct on 512
/// ranks, 5e8, takes 8 s).
const LEAVE_OUT_WORK: usize = 1 << 32;

/// Runs this same command again with glibc's malloc asking for transparent
/// huge pages (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, read only at
/// start), for large simulations when the caller set no tunables. Returns
/// if it cannot.
pub fn with_huge_pages(a: &SimArgs) {
    use std::os::unix::process::CommandExt;
    const TUNABLES: &str = "GLIBC_TUNABLES";
    if a.ranks < HUGE_PAGES_FROM_RANKS || std::env::var_os(TUNABLES).is_some() {
        return;
    }
    let Ok(me) = std::env::current_exe() else {
        return;
    };
    let err = std::process::Command::new(me)
        .args(std::env::args_os().skip(1))
        .env(TUNABLES, "glibc.malloc.hugetlb=1")
        .exec();
    eprintln!("collbench simulate: could not run again with huge pages ({err}); going on without");
}

pub fn run(a: &SimArgs) -> Result<(), String> {
    let cluster = cluster(a);
    cluster.validate()?;
    let kind = a.collective.to_ascii_lowercase();
    if let Some(p) = simulate::control::predict(&kind, &cluster) {
        return super::control::report(&kind, &cluster, &p, a.json.as_deref());
    }
    let collective = parse_collective(&a.collective)?;
    let defaults = Pipeline::default();
    let pipeline = Pipeline {
        chunk: a.chunk.map_or(defaults.chunk, |c| c as usize),
        depth: a.depth.unwrap_or(defaults.depth),
    };
    let algos = algorithms(collective, a.algo.as_deref(), &cluster)?;
    let mut out = report::table_out(a.json.as_deref());
    let io = |e: std::io::Error| e.to_string();
    writeln!(out, "# collbench simulate: {collective} on {cluster}").map_err(io)?;
    writeln!(
        out,
        "# chunk {} B, depth {}, {}; '*' the selector's pick, '<' the fastest",
        pipeline.chunk,
        pipeline.depth,
        a.dtype.name()
    )
    .map_err(io)?;
    writeln!(
        out,
        "# {:>10}  {:>12}  {:<14} {:>12} {:>8} {:>8} {:>11} {:>10} {:>8}",
        "size", "count", "algorithm", "time", "algbw", "busbw", "messages", "events", "wall"
    )
    .map_err(io)?;
    writeln!(
        out,
        "# {:>10}  {:>12}  {:<14} {:>12} {:>8} {:>8} {:>11} {:>10} {:>8}",
        "(B)", "(elements)", "", "(us)", "(GB/s)", "(GB/s)", "", "", "(s)"
    )
    .map_err(io)?;
    let mut rows = Vec::new();
    for size in a.sizes()? {
        let size = size as usize;
        let mut predictions = Vec::new();
        for algo in &algos {
            if algos.len() > 1 {
                let f = simulate::footprint(&cluster, algo, size, a.dtype, pipeline);
                if f.work() > LEAVE_OUT_WORK {
                    writeln!(
                        out,
                        "#   {} at {size} B left out: {} steps, each rank looking at its {} queues \
                         whenever it runs (minutes or more here); --algo {} runs it",
                        algo.name, f.steps, f.queues, algo.name
                    )
                    .map_err(io)?;
                    continue;
                }
            }
            let started = Instant::now();
            let mut logged = started;
            let mut report = |st: Status| {
                let line = format!(
                    "collbench simulate: {} at {size} B: {:.1} M wake-ups, {:.1} M messages, {:.3} ms simulated, {:.0} s",
                    algo.name,
                    st.events as f64 * 1e-6,
                    st.messages as f64 * 1e-6,
                    st.seconds * 1e3,
                    started.elapsed().as_secs_f64()
                );
                if std::io::stderr().is_terminal() {
                    eprint!("\r{line}\x1b[K");
                } else if logged.elapsed() >= Duration::from_secs(10) {
                    // A log gets a line every 10 s.
                    logged = Instant::now();
                    eprintln!("{line}");
                }
            };
            let result =
                simulate::simulate_reporting(&cluster, algo, size, a.dtype, pipeline, &mut report);
            if std::io::stderr().is_terminal() && started.elapsed() > Duration::from_secs(1) {
                eprint!("\r\x1b[K");
            }
            match result {
                Ok(p) => predictions.push(p),
                // With every algorithm asked for, one too large to hold is left out.
                Err(e) if algos.len() > 1 => writeln!(out, "#   {e}").map_err(io)?,
                Err(e) => return Err(e),
            }
        }
        let rendezvous = cluster.rendezvous;
        let (n, per_host) = (cluster.ranks, cluster.ranks_per_host);
        let (pick, why) =
            simulate::unprofiled_choice(n, per_host, rendezvous, collective, size, pipeline);
        let best = (predictions.iter())
            .min_by(|x, y| x.seconds.total_cmp(&y.seconds))
            .map(|p| p.algorithm);
        for p in &predictions {
            let row = row(collective, &cluster, p, a.dtype.size(), pick.name, best);
            print_row(&mut out, &row).map_err(io)?;
            rows.push(row);
        }
        if algos.len() > 1 {
            writeln!(out, "#   selector: {} ({why})", pick.name).map_err(io)?;
        }
    }
    if let Some(path) = &a.json {
        let report = Report {
            collective: collective.name(),
            cluster: cluster.to_string(),
            ranks: cluster.ranks,
            ranks_per_host: cluster.ranks_per_host,
            chunk: pipeline.chunk,
            depth: pipeline.depth,
            dtype: a.dtype.name(),
            results: rows,
        };
        report::write_json(path, &report)?;
    }
    Ok(())
}

fn parse_collective(name: &str) -> Result<Collective, String> {
    (Collective::ALL.into_iter())
        .filter(|c| *c != Collective::AllToAllV)
        .find(|c| c.name() == name.to_ascii_lowercase())
        .ok_or_else(|| {
            format!("'{name}' is not a collective the simulator runs (allreduce, alltoall, reducescatter, allgather, broadcast, reduce, barrier), nor init, agree or shrink")
        })
}

fn cluster(a: &SimArgs) -> Cluster {
    Cluster {
        ranks: a.ranks,
        ranks_per_host: a.ranks_per_host.max(1),
        link: Link {
            bandwidth: a.link / 8.0,
            latency: a.link_latency,
        },
        intra: Link {
            bandwidth: a.intra / 8.0,
            latency: a.intra_latency,
        },
        overhead: a.overhead,
        reduce_bandwidth: a.reduce_bw,
        oversubscription: a.oversubscription,
        rendezvous: a.transport == "verbs",
    }
}

/// The algorithms to simulate: the one named, or every one that runs as
/// itself on this cluster.
fn algorithms(
    collective: Collective,
    name: Option<&str>,
    cluster: &Cluster,
) -> Result<Vec<&'static Algorithm>, String> {
    let hosts = cluster.host_ranks();
    match name {
        Some(name) => algo::find(collective, name)
            .map(|a| vec![a])
            .ok_or_else(|| {
                format!(
                    "no {collective} algorithm named '{name}' (available: {})",
                    algo::names(collective).join(", ")
                )
            }),
        None => Ok((algo::ALGORITHMS.iter())
            .filter(|a| a.collective == collective && algo::fits(a.name, &hosts))
            .collect()),
    }
}

fn row(
    collective: Collective,
    cluster: &Cluster,
    p: &Prediction,
    elem: usize,
    pick: &str,
    best: Option<&str>,
) -> Row {
    let algbw = match p.seconds {
        s if s > 0.0 => p.bytes as f64 / s / 1e9,
        _ => 0.0,
    };
    Row {
        size: p.bytes,
        count: p.bytes / elem,
        algorithm: p.algorithm,
        time_us: p.seconds * 1e6,
        algbw_gbs: algbw,
        busbw_gbs: algbw * collective.bus_factor(cluster.ranks),
        selected: p.algorithm == pick,
        fastest: Some(p.algorithm) == best,
        messages: p.messages,
        events: p.events,
        wall_s: p.wall.as_secs_f64(),
    }
}

fn print_row(out: &mut dyn Write, r: &Row) -> std::io::Result<()> {
    let marks = format!(
        "{}{}",
        if r.selected { "*" } else { "" },
        if r.fastest { "<" } else { "" }
    );
    writeln!(
        out,
        "  {:>10}  {:>12}  {:<14} {:>12.2} {:>8.2} {:>8.2} {:>11} {:>10} {:>8.2}",
        r.size,
        r.count,
        format!("{}{marks}", r.algorithm),
        r.time_us,
        r.algbw_gbs,
        r.busbw_gbs,
        r.messages,
        r.events,
        r.wall_s
    )?;
    out.flush()
}
