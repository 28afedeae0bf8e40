//! What group calls buy, measured: AllToAll written as grouped sends and
//! receives (as nccl-tests writes it) against `all_to_all`; 100 AllReduces
//! of 4 KiB in one group (fused) against one by one; a 256 MiB ring
//! exchange in a group against one 256 MiB send between two ranks.
//!
//!     cargo run --release -p collectives --example groups -- --ranks 4
//!
//! Starts the ranks itself (or runs as one rank under a launcher); rank 0
//! prints medians of interleaved repetitions.

use std::time::{Duration, Instant};

use collectives::bootstrap::{launch, under_launcher};
use collectives::{Communicator, ReduceOp};

const REPS: usize = 5;

fn main() {
    let mut ranks = 4;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--ranks" => ranks = args.next().and_then(|n| n.parse().ok()).expect("--ranks N"),
            other => panic!("unknown flag {other} (--ranks N)"),
        }
    }
    if !under_launcher() {
        let job = launch::Launch {
            nranks: ranks,
            program: std::env::current_exe().unwrap(),
            args: std::env::args_os().skip(1).collect(),
            env: Vec::new(),
            timeout: Duration::from_secs(300),
            bind: launch::Bind::from_env().unwrap(),
        };
        let outcome = launch::run(&job).expect("launching the ranks");
        std::process::exit(if outcome.success() { 0 } else { 1 });
    }
    let mut comm = Communicator::from_env().unwrap();
    if let Err(e) = run(&mut comm) {
        eprintln!("{e}");
        std::process::exit(1);
    }
}

/// The slowest rank's median seconds of `f` over `REPS` runs of `iters` calls.
fn time(comm: &mut Communicator, iters: usize, mut f: impl FnMut(&mut Communicator)) -> f64 {
    let mut runs = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        comm.barrier().unwrap();
        let t0 = Instant::now();
        for _ in 0..iters {
            f(comm);
        }
        let mut t = [t0.elapsed().as_secs_f64() / iters as f64];
        comm.all_reduce_in_place(&mut t, ReduceOp::Max).unwrap();
        runs.push(t[0]);
    }
    runs.sort_by(f64::total_cmp);
    runs[REPS / 2]
}

fn run(comm: &mut Communicator) -> collectives::Result<()> {
    let (n, me) = (comm.size(), comm.rank());
    let say = |line: String| {
        if me == 0 {
            println!("{line}");
        }
    };
    say(format!(
        "# groups, {n} ranks, medians of {REPS} (slowest rank)"
    ));
    say(format!(
        "# {:>10} {:>14} {:>14} {:>8}",
        "per peer", "all_to_all us", "grouped us", "ratio"
    ));
    for per_peer in [
        1usize << 10,
        16 << 10,
        256 << 10,
        1 << 20,
        16 << 20,
        64 << 20,
    ] {
        let words = per_peer / 4;
        let send = vec![me as f32; words * n];
        let mut recv = vec![0f32; words * n];
        let iters = if per_peer <= 256 << 10 { 50 } else { 3 };
        let flat = time(comm, iters, |c| c.all_to_all(&send, &mut recv).unwrap());
        let grouped = time(comm, iters, |c| {
            let mut g = c.group();
            for (r, out) in recv.chunks_mut(words).enumerate() {
                g.send(&send[r * words..(r + 1) * words], r).unwrap();
                g.recv(out, r).unwrap();
            }
            g.end().unwrap()
        });
        say(format!(
            "  {per_peer:>10} {:>14.1} {:>14.1} {:>8.2}",
            flat * 1e6,
            grouped * 1e6,
            grouped / flat
        ));
    }
    let mut bufs: Vec<Vec<f32>> = (0..100).map(|_| vec![1.0f32; 1024]).collect();
    let one_by_one = time(comm, 5, |c| {
        for b in bufs.iter_mut() {
            c.all_reduce_in_place(b, ReduceOp::Sum).unwrap();
        }
    });
    let fused = time(comm, 5, |c| {
        let mut g = c.group();
        for b in bufs.iter_mut() {
            g.all_reduce_in_place(b, ReduceOp::Sum).unwrap();
        }
        g.end().unwrap()
    });
    say(format!(
        "# 100 AllReduces of 4 KiB: one by one {:.0} us, in a group (fused) {:.0} us: {:.1}x",
        one_by_one * 1e6,
        fused * 1e6,
        one_by_one / fused
    ));
    let words = (256 << 20) / 8;
    let out = vec![me as u64; words];
    let mut inp = vec![0u64; words];
    let ring = time(comm, 1, |c| {
        let mut g = c.group();
        g.send(&out, (me + 1) % n).unwrap();
        g.recv(&mut inp, (me + n - 1) % n).unwrap();
        g.end().unwrap()
    });
    // The transport's own speed: one 256 MiB message from rank 0 to rank 1.
    let single = time(comm, 1, |c| match c.rank() {
        0 => c.send(&out, 1).unwrap(),
        1 => c.recv(&mut inp, 0).unwrap(),
        _ => {}
    });
    let gbs = |s: f64| 268_435_456.0 / s / 1e9;
    say(format!(
        "# 256 MiB ring exchange in a group: {:.1} ms ({:.2} GB/s per rank); one 256 MiB send 0->1: {:.1} ms ({:.2} GB/s)",
        ring * 1e3,
        gbs(ring),
        single * 1e3,
        gbs(single)
    ));
    Ok(())
}
