//! Command-line interface.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use collectives::{parse_seconds, parse_size, DataType, ReduceOp};

const EXAMPLES: &str = "\
Examples:
  collbench allreduce -n 8 --size 1G                 8 local ranks, one 1 GiB AllReduce size
  collbench allreduce -n 4 -b 8 -e 256M -f 4 -c 1    sweep 8 B..256 MiB, x4 per step, checked
  collbench alltoall -n 4 -b 1K -e 64M -d bf16 --json out.json
  mpirun -n 4 collbench allreduce -b 8 -e 128M       one rank per MPI process (MASTER_ADDR/PORT set)
  RANK=0 WORLD_SIZE=2 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 collbench allreduce

Columns are those of nccl-tests: time is the mean per call over the timed
iterations, the maximum over ranks; algbw = size / time; busbw = algbw x the
collective's factor (allreduce 2(n-1)/n; alltoall, reducescatter, allgather
(n-1)/n; broadcast, reduce 1), comparable to the link bandwidth. For
reducescatter and allgather the size is that of the whole (larger) buffer. #wrong counts result elements that differ from the expected
value, summed over ranks; the exit status is non-zero if any is wrong or any
rank fails.

Environment: COLL_DEBUG=INFO logs the transport, algorithm, chunk and peers;
COLL_TIMEOUT, COLL_CHUNK, COLL_DEPTH, COLL_ALGO, COLL_TRANSPORT set defaults
that the flags override.";

#[derive(Parser, Debug)]
#[command(
    name = "collbench",
    version,
    about = "Measure collective bandwidth the way nccl-tests does",
    after_help = EXAMPLES
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// AllReduce: every rank ends with the reduction of every rank's buffer
    #[command(after_help = EXAMPLES)]
    Allreduce(BenchArgs),
    /// AllToAll: rank i's block j goes to rank j's block i
    #[command(after_help = EXAMPLES)]
    Alltoall(BenchArgs),
    /// AllToAllv: rank i sends rank j a block of its own size; each rank's
    /// buffer (size) is cut among the ranks by a Zipf law (seeded, the same
    /// on every rank), and busbw counts the bytes the busiest rank sends to
    /// the others
    #[command(after_help = EXAMPLES)]
    Alltoallv(BenchArgs),
    /// ReduceScatter: rank i ends with block i of the reduction (size = the whole buffer)
    #[command(after_help = EXAMPLES)]
    Reducescatter(BenchArgs),
    /// AllGather: every rank ends with every rank's block (size = the gathered buffer)
    #[command(after_help = EXAMPLES)]
    Allgather(BenchArgs),
    /// Broadcast: every rank ends with the root's buffer
    #[command(after_help = EXAMPLES)]
    Broadcast(BenchArgs),
    /// Reduce: the root ends with the reduction of every rank's buffer
    #[command(after_help = EXAMPLES)]
    Reduce(BenchArgs),
    /// List the registered algorithms (the names --algo accepts)
    Algorithms,
    /// Merge the flight records ranks dumped into DIR (on a failure, on
    /// SIGUSR1, or on request; COLL_TRACE_DUMP_DIR, default coll-traces-UID
    /// in the temp dir)
    /// and name the rank at fault: collbench trace /tmp/coll-traces-$(id -u)
    Trace {
        /// The directory holding coll-trace-rank*.json
        dir: PathBuf,
    },
    /// Chart bus bandwidth and time per call against size, one series per
    /// result file (collbench --json): collbench plot a.json b.json -o chart.svg
    /// (SVG, or PNG by the extension)
    Plot {
        /// Result files (collbench --json, or the same shape with a "label")
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// The chart to write (.svg or .png)
        #[arg(short = 'o', long = "out", default_value = "chart.svg")]
        out: PathBuf,
    },
    /// Predict a collective's time on a cluster this machine is not: every
    /// rank's real schedule run by the real executor on a model of the
    /// cluster (NICs, shared memory, per-message costs): collbench simulate
    /// allreduce --ranks 4096 --size 8,1M,256M
    #[command(after_help = SIMULATE_EXAMPLES)]
    Simulate(SimArgs),
    /// Measure every algorithm of allreduce, broadcast and reduce in this
    /// setting (ranks, ranks per host, transport) and write the selector's
    /// profile: collbench tune -n 8 [--out FILE]
    Tune(TuneArgs),
}

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Ranks to start on this host. Leave out when a launcher (mpirun,
    /// torchrun, a scheduler) starts one collbench per rank.
    #[arg(short = 'n', long = "nranks")]
    pub nranks: Option<usize>,

    /// Smallest size in bytes (K, M, G suffixes: binary multiples)
    #[arg(short = 'b', long = "minbytes", default_value = "32M", value_parser = size)]
    pub minbytes: u64,

    /// Largest size in bytes
    #[arg(short = 'e', long = "maxbytes", default_value = "32M", value_parser = size)]
    pub maxbytes: u64,

    /// Multiply the size by this between steps of the sweep
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2.0)]
    pub stepfactor: f64,

    /// Run these sizes only, comma-separated: `--size 8,1M,16M` (instead of -b/-e/-f)
    #[arg(long, value_delimiter = ',', value_parser = size)]
    pub size: Option<Vec<u64>>,

    /// Timed iterations per size [default: up to 64 MiB, as many as fill
    /// 50 ms at the warm-up's pace, so that a size spans several scheduler
    /// time slices (with other work on a core, 1000 calls of 8 B, 0.3 ms,
    /// or 20 of 1 MiB, 2 ms, fall in a good slice or a bad one): 1000 to a
    /// million up to 64 KiB, 20 to 1000 above; above 64 MiB, fewer, so a
    /// size moves about 1.3 GiB per rank: 5 at 256 MiB, 2 at 1 GiB]
    #[arg(long)]
    pub iters: Option<usize>,

    /// Untimed iterations before timing [default: 100 up to 64 KiB, 5 up to
    /// 64 MiB; above, 1, or 0 when checking, whose call warms the same buffers]
    #[arg(short = 'w', long)]
    pub warmup: Option<usize>,

    /// Milliseconds of barriers before the first size, so every rank is
    /// where the scheduler will keep it: a job's ranks start wherever the
    /// kernel forks them and move between the cores for the next tens of
    /// milliseconds (with other work on a core, 3 ms stalls meanwhile, which
    /// 1000 calls of 8 B would average into 5 us a call), and on a VM calls
    /// run up to 3x slower for the first 100-250 ms (2-rank 8 B Broadcast
    /// 0.15-0.32 us a call, then 0.08-0.15 as the minute goes). 0: none.
    /// (mpirun and torch take 0.3 s and more to start their ranks, which
    /// settles them)
    #[arg(long, default_value_t = 300)]
    pub settle: u64,

    /// Rewrite every cache line of each call's input just before the call
    /// (same values; timed with the call), as a training step leaves fresh
    /// gradients. Without it the input is the same memory, unchanged, call
    /// after call (as in nccl-tests): a library that reads its peers'
    /// buffers in place (Open MPI's single copy, CMA) finds them in its own
    /// cache from the call before, which flatters it wherever moving a line
    /// between cores is slow
    #[arg(long)]
    pub fresh: bool,

    /// Allocate both buffers as `SharedBuffer`s (memory peers on the host
    /// can map, as NCCL's ncclMemAlloc; nccl-tests' -R): a peer reads a
    /// large message from them with memcpy instead of process_vm_readv.
    /// Their pages are 4 KiB unless
    /// /sys/kernel/mm/transparent_hugepage/shmem_enabled is "advise"
    /// [default: on if COLL_SHARED_BUFFERS=1]
    #[arg(long)]
    pub shared_buffers: bool,

    /// Check results against the expected values (1) or not (0)
    #[arg(short = 'c', long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub check: u8,

    /// Element type: float, double, half, bfloat16, int8, uint8, int32,
    /// uint32, int64, uint64 (or f32, bf16, i8, ...)
    #[arg(short = 'd', long, default_value = "float")]
    pub dtype: DataType,

    /// Reduction (allreduce, reducescatter, reduce): sum, prod, min, max, avg
    #[arg(short = 'o', long, default_value = "sum")]
    pub op: ReduceOp,

    /// Root rank (broadcast, reduce)
    #[arg(short = 'r', long, default_value_t = 0)]
    pub root: usize,

    /// Transport between ranks: auto (shared memory within a host; RDMA
    /// verbs, else TCP, between hosts), tcp, shm, or verbs (also within a
    /// host, for testing; builds with the verbs feature) [default: auto, or
    /// COLL_TRANSPORT]
    #[arg(long)]
    pub transport: Option<String>,

    /// Force an algorithm (see `collbench algorithms`) [default: the selector's choice]
    #[arg(long)]
    pub algo: Option<String>,

    /// Pipeline chunk size in bytes [default: 1M, or COLL_CHUNK]
    #[arg(long, value_parser = size)]
    pub chunk: Option<u64>,

    /// Chunks in flight per peer and direction [default: 4, or COLL_DEPTH]
    #[arg(long)]
    pub depth: Option<usize>,

    /// Seconds any wait may go without progress before the run fails with
    /// the stalled peer named [default: 60, or COLL_TIMEOUT]
    #[arg(long, value_parser = secs)]
    pub timeout: Option<Duration>,

    /// Also write the results as JSON to this file ('-': stdout, the table then goes to stderr)
    #[arg(long)]
    pub json: Option<PathBuf>,

    /// Allow -n above 32 ranks per core (mpirun's flag of the same name)
    #[arg(long)]
    pub oversubscribe: bool,

    /// With -n: bind rank i to the i-th core this process may use ("core",
    /// when there are enough; as mpirun does), or leave ranks to the
    /// scheduler ("none") [default: COLL_BIND, else core]
    #[arg(long, value_parser = ["core", "none"])]
    pub bind: Option<String>,
}

const SIMULATE_EXAMPLES: &str = "\
Examples:
  collbench simulate allreduce --ranks 4096 --size 8,1M,256M
  collbench simulate alltoall --ranks 64 --ranks-per-host 8 -b 1K -e 64M --algo pairwise
  collbench simulate allreduce --ranks 512 --size 1G --link 100G --oversubscription 2 --json out.json
  collbench simulate init --ranks 100000      (forming a job: rendezvous and relay tree)
  collbench simulate shrink --ranks 10000     (agreeing on a lost rank, with new addresses)

Each algorithm's schedules are those a communicator builds, run by the same
executor (chunks, depth, staging slots), so what is predicted is what runs.
The model (collectives/src/simulate/model.rs): a message waits for its
receive to be posted (over the network plus one latency, the clear-to-send),
then for its host's NIC to be free, takes size / bandwidth on the wire and
lands a latency later; a host's ranks share its NIC; shared memory is a port
per rank; posting a message costs --overhead of the rank's CPU, reducing
size / --reduce-bw. The selector's pick is marked '*', the fastest '<'.

init, agree and shrink predict the control plane instead (its model and
measured CPU costs: collectives/src/simulate/control.rs): the rendezvous's
relay tree, the agreement's coordinator and tree of askers, their rounds,
messages and the most bytes one rank sends.";

#[derive(Args, Debug, Clone)]
pub struct SimArgs {
    /// allreduce, alltoall, reducescatter, allgather, broadcast, reduce or
    /// barrier; or init, agree or shrink (forming a job, agreeing on a lost rank)
    pub collective: String,

    /// Ranks in the job
    #[arg(long)]
    pub ranks: usize,

    /// Ranks per host (the last host may have fewer)
    #[arg(long, default_value_t = 8)]
    pub ranks_per_host: usize,

    /// Sizes, comma-separated, per rank as collbench counts them [default: 8,1M,256M]
    #[arg(long, value_delimiter = ',', value_parser = size)]
    pub size: Option<Vec<u64>>,

    /// Smallest size of a sweep (with -e, instead of --size)
    #[arg(short = 'b', long = "minbytes", value_parser = size)]
    pub minbytes: Option<u64>,

    /// Largest size of a sweep
    #[arg(short = 'e', long = "maxbytes", value_parser = size)]
    pub maxbytes: Option<u64>,

    /// Multiply the size by this between steps of the sweep
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4.0)]
    pub stepfactor: f64,

    /// Simulate only this algorithm [default: every one of the collective]
    #[arg(long)]
    pub algo: Option<String>,

    /// Each host's NIC, bits per second (K, M, G, T: decimal)
    #[arg(long, default_value = "400G", value_parser = bits)]
    pub link: f64,

    /// Latency between hosts (s, ms, us, ns)
    #[arg(long, default_value = "2us", value_parser = duration)]
    pub link_latency: f64,

    /// Between ranks of one host, bits per second
    #[arg(long, default_value = "200G", value_parser = bits)]
    pub intra: f64,

    /// Latency between ranks of one host
    #[arg(long, default_value = "0.5us", value_parser = duration)]
    pub intra_latency: f64,

    /// CPU time to post one message
    #[arg(long, default_value = "0.5us", value_parser = duration)]
    pub overhead: f64,

    /// Bytes per second one core reduces (K, M, G: decimal)
    #[arg(long, default_value = "20G", value_parser = bits)]
    pub reduce_bw: f64,

    /// The network core carries this much less than the NICs' sum (1: full bisection)
    #[arg(long, default_value_t = 1.0)]
    pub oversubscription: f64,

    /// Between hosts: verbs (a message waits for its receive's
    /// clear-to-send) or tcp (it leaves at once and waits in the receiver's
    /// buffer)
    #[arg(long, default_value = "verbs", value_parser = ["verbs", "tcp"])]
    pub transport: String,

    /// Pipeline chunk size in bytes [default: the communicator's, 1M]
    #[arg(long, value_parser = size)]
    pub chunk: Option<u64>,

    /// Chunks in flight per peer and direction [default: the communicator's, 4]
    #[arg(long)]
    pub depth: Option<usize>,

    /// Element type
    #[arg(short = 'd', long, default_value = "float")]
    pub dtype: DataType,

    /// Also write the predictions as JSON to this file ('-': stdout, the table then goes to stderr)
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// `400G` (decimal multiples, an optional `b`, `bps` or `B/s` ignored) as a number.
fn bits(s: &str) -> Result<f64, String> {
    let t = s
        .trim()
        .trim_end_matches("ps")
        .trim_end_matches("/s")
        .trim_end_matches(['b', 'B']);
    let (num, scale) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 1e3),
        Some((i, 'M')) => (&t[..i], 1e6),
        Some((i, 'G')) => (&t[..i], 1e9),
        Some((i, 'T')) => (&t[..i], 1e12),
        _ => (t, 1.0),
    };
    match num.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v * scale),
        _ => Err(format!("'{s}' is not a positive rate like 400G")),
    }
}

/// `2us`, `500ns`, `1.5ms`, `0` as seconds.
fn duration(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let (num, scale) = [("ns", 1e-9), ("us", 1e-6), ("ms", 1e-3), ("s", 1.0)]
        .iter()
        .find_map(|(unit, scale)| t.strip_suffix(unit).map(|n| (n, *scale)))
        .unwrap_or((t, 1.0));
    match num.trim().parse::<f64>() {
        Ok(v) if v >= 0.0 && v.is_finite() => Ok(v * scale),
        _ => Err(format!("'{s}' is not a time like 2us")),
    }
}

impl SimArgs {
    /// The sizes to simulate, in bytes.
    pub fn sizes(&self) -> Result<Vec<u64>, String> {
        match (&self.size, self.minbytes, self.maxbytes) {
            (Some(list), None, None) => Ok(list.clone()),
            (None, None, None) => Ok(vec![8, 1 << 20, 256 << 20]),
            (None, lo, hi) => sweep(lo.or(hi).unwrap(), hi.or(lo).unwrap(), self.stepfactor),
            _ => Err("give either --size or -b/-e".into()),
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct TuneArgs {
    /// The profile to write (lines of other settings are kept) [default:
    /// ~/.cache/collectives/profile.tsv, which every communicator reads;
    /// COLL_PROFILE names another]
    #[arg(long)]
    pub out: Option<PathBuf>,

    /// Sizes to measure, comma-separated [default: 8,1K,32K,256K,1M,4M,16M]
    #[arg(long = "sizes", value_delimiter = ',', value_parser = size)]
    pub sizes: Option<Vec<u64>>,

    #[command(flatten)]
    pub bench: BenchArgs,
}

fn size(s: &str) -> Result<u64, String> {
    parse_size(s)
}

fn secs(s: &str) -> Result<Duration, String> {
    parse_seconds(s)
}

impl BenchArgs {
    /// Whether the buffers are `SharedBuffer`s: `--shared-buffers`, or
    /// COLL_SHARED_BUFFERS=1 (which scripts set for a whole comparison).
    pub fn shared_buffers(&self) -> bool {
        self.shared_buffers || std::env::var("COLL_SHARED_BUFFERS").is_ok_and(|v| v == "1")
    }

    /// The sizes of the sweep, in bytes.
    pub fn sizes(&self) -> Result<Vec<u64>, String> {
        if let Some(list) = &self.size {
            return Ok(list.clone());
        }
        sweep(self.minbytes, self.maxbytes, self.stepfactor)
    }

    /// Timed and warm-up iterations for a size (ci/mpibench.c and
    /// ci/gloo_bench.py follow the same rules); where the timed ones are to
    /// be [`paced`](Self::paced), the count here is their least.
    pub fn iterations(&self, bytes: u64) -> (usize, usize) {
        let iters = self.iters.unwrap_or(match bytes {
            b if b <= SMALL => 1000,
            b if b <= BIG => 20,
            b => (20 * BIG).div_ceil(b).max(2) as usize,
        });
        let warmup = self.warmup.unwrap_or(match (bytes, self.check) {
            (b, _) if b <= SMALL => 100,
            (b, _) if b <= BIG => 5,
            (_, 0) => 1,
            _ => 0,
        });
        (iters.max(1), warmup)
    }

    /// Whether a size's timed iterations are [`paced`](Self::paced).
    pub fn paces(&self, bytes: u64) -> bool {
        self.iters.is_none() && bytes <= BIG
    }

    /// The timed iterations of a size whose warm-up calls took `pace`
    /// seconds each (the slowest rank's, so that every rank agrees): as
    /// many as fill `PACED_SPAN`, from `iters` (`iterations`' count, the
    /// least) up to `SMALL_MAX_ITERS` or `PACED_MAX_ITERS`, when `--iters`
    /// was not given; else `iters`.
    pub fn paced(&self, bytes: u64, iters: usize, pace: f64) -> usize {
        if !self.paces(bytes) || pace <= 0.0 {
            return iters;
        }
        let most = match bytes <= SMALL {
            true => SMALL_MAX_ITERS,
            false => PACED_MAX_ITERS,
        };
        // `as` saturates: a pace of a few ns is no overflow.
        let want = (PACED_SPAN / pace).ceil() as usize;
        want.min(most).max(iters)
    }
}

/// Up to this size a call takes microseconds: at least 1000 calls.
const SMALL: u64 = 64 << 10;
/// Above this size, a count that moves about 1.3 GiB per rank.
const BIG: u64 = 64 << 20;
/// Up to `BIG`, seconds of timed calls (see `--iters`), in at most so many.
pub const PACED_SPAN: f64 = 0.05;
const SMALL_MAX_ITERS: usize = 1_000_000;
const PACED_MAX_ITERS: usize = 1000;

/// Sizes from `lo` to `hi` (both included when `hi` is on the way), each
/// `factor` times the one before (at least one byte more).
fn sweep(lo: u64, hi: u64, factor: f64) -> Result<Vec<u64>, String> {
    if lo > hi {
        return Err(format!("minbytes {lo} is above maxbytes {hi}"));
    }
    // NaN, infinity and factors of 1 or less would never reach maxbytes.
    if !(factor.is_finite() && factor > 1.0) {
        return Err(format!(
            "the step factor (-f) {factor} is not a number above 1"
        ));
    }
    let mut sizes = vec![lo];
    while let Some(&last) = sizes.last() {
        let next = (last.max(1) as f64 * factor).round();
        if next > hi as f64 {
            break;
        }
        sizes.push((next as u64).max(last + 1));
        if sizes.len() > MAX_SIZES {
            return Err(format!(
                "-b {lo} -e {hi} -f {factor} makes over {MAX_SIZES} sizes: take a larger step"
            ));
        }
    }
    Ok(sizes)
}

/// The most sizes a sweep may have.
const MAX_SIZES: usize = 10_000;

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn args(extra: &[&str]) -> BenchArgs {
        let cli = Cli::try_parse_from([&["collbench", "allreduce"], extra].concat()).unwrap();
        match cli.command {
            Command::Allreduce(a) => a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn sweeps_that_would_never_end_are_refused() {
        for bad in [
            &["-b", "8", "-e", "1M", "-f", "nan"][..],
            &["-b", "8", "-e", "8", "-f", "0"],
            &["-b", "8", "-e", "1M", "-f", "inf"],
            &["-b", "8", "-e", "1M", "-f", "1.0000001"],
        ] {
            assert!(args(bad).sizes().is_err(), "{bad:?}");
        }
        assert!(Cli::try_parse_from(["collbench", "allreduce", "-e", "1e30"]).is_err());
        let top = args(&["-b", "1T", "-e", "1024T", "-f", "2"])
            .sizes()
            .unwrap();
        assert_eq!(top.len(), 11);
        assert_eq!(args(&["-b", "8", "-e", "8"]).sizes().unwrap(), vec![8]);
    }

    #[test]
    fn timed_calls_fill_the_span_within_each_sizes_bounds() {
        let a = args(&[]);
        // 8 B at 0.1 us a call: 50 ms is half a million calls (rounded up).
        assert!((500_000..=500_001).contains(&a.paced(8, 1000, 1e-7)));
        assert_eq!(a.paced(8, 1000, 1e-9), 1_000_000);
        assert_eq!(a.paced(64 << 10, 1000, 1e-3), 1000);
        // 1 MiB at 100 us: 500, within 20..=1000.
        assert!((500..=501).contains(&a.paced(1 << 20, 20, 1e-4)));
        assert_eq!(a.paced(1 << 20, 20, 1.0), 20);
        // Above 64 MiB, and with --iters, the count stands.
        assert_eq!(a.paced(256 << 20, 5, 1e-4), 5);
        let fixed = args(&["--iters", "7"]);
        assert_eq!(fixed.paced(8, 7, 1e-7), 7);
        assert!(!fixed.paces(8));
    }
}
