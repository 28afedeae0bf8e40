//! One rank's benchmark: join the job, sweep the sizes (`bench`: time and
//! check each call; `data`: the inputs and their expected results; `skew`:
//! AllToAllv's split), and on rank 0 print the table and write the JSON.

pub(crate) mod bench;
pub(crate) mod data;
pub(crate) mod skew;

use std::io::Write;

use collectives::bootstrap::Bootstrap;
use collectives::{Collective, Communicator};

use crate::cli::{self, BenchArgs};
use crate::launch::preflight;
use crate::report::{self, human_bytes};
use crate::settings::config;
use bench::Bench;

/// This process is one rank: join the job, sweep, report (rank 0).
pub(crate) fn run_rank(collective: Collective, args: &BenchArgs) -> Result<bool, String> {
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
    let mut out: Box<dyn Write> = match rank0 {
        false => Box::new(std::io::sink()),
        true => report::table_out(args.json.as_deref()),
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
    let most = maxima(bench.comm).map_err(|e| e.to_string())?;
    let summary = report::Summary::of(&rows, most, bench.comm.config().eager_connect);
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
            report::write_json(path, &doc)?;
        }
    }
    Ok(summary.wrong == 0)
}

/// Every rank's peak memory and start-up figures, the largest of each
/// over the ranks.
fn maxima(comm: &mut Communicator) -> collectives::Result<report::Maxima> {
    let s = comm.stats();
    let mut max = [
        bench::peak_rss() as f64,
        s.init_seconds,
        s.connections as f64,
        s.connect_seconds,
    ];
    comm.all_reduce_in_place(&mut max, collectives::ReduceOp::Max)?;
    Ok(report::Maxima {
        peak_rss_bytes_max: max[0] as u64,
        init_seconds_max: max[1],
        connections_max: max[2] as u64,
        connect_seconds_max: max[3],
    })
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
