//! The rank program of the integration tests. `coll-worker --ranks N MODE`
//! launches N ranks of itself on this host (as `collbench -n N` does); each
//! rank then runs MODE:
//!
//! * `matrix`: every dtype x op x size x in/out-of-place for allreduce, and
//!   alltoall, on random data, against a reference computed here;
//! * `mismatch KIND`: rank 1 calls with another count, dtype or op;
//! * `die` / `stall`: rank 1 is SIGKILLed / SIGSTOPped in the middle of a
//!   large allreduce;
//! * `late`: rank 1 arrives after everyone's timeout;
//! * `pingpong N`: N small allreduces (for jobs started by hand);
//! * `overlap`: non-blocking sends to the next rank and receives from the
//!   previous one, 64 MiB each, started together with an AllReduce;
//! * `split`: even and odd ranks split off; each child and the parent run
//!   AllReduces at once, from three threads;
//! * `abort`: rank 0 blocks in a receive rank 1 never answers and a second
//!   thread aborts it; rank 1 blocks in a barrier;
//! * `mismatch-v` / `mismatch-p2p`: rank 1 expects another count than its
//!   peer sends, in an AllToAllv / a send-recv pair;
//! * `group`: AllToAll as grouped sends and receives (self included) equal
//!   to `all_to_all`; a 64 MiB ring exchange in one group; 100 small
//!   AllReduces in a group (fused) equal to one by one;
//! * `group-die`: rank 1 exits; the others' group reports it at its end;
//! * `pause`: 256 MiB AllToAlls in a loop while rank 0 stops rank 1 for 10 s
//!   and resumes it: results right, every rank's peak memory its buffers
//!   plus bounded staging (printed as `peak RANK BYTES`);
//! * `skip` / `different`: rank 1 skips an AllReduce / calls an AllGather
//!   where the others call an AllReduce (for the flight-record tests);
//! * `behind`: rank 1 computes past the timeout before an AllReduce the
//!   others are in (for the root-cause line of their timeout);
//! * `elastic SEED STEPS`: one or two ranks kill themselves at random
//!   moments (or the second as the recovery from the first begins); the
//!   others agree, shrink and finish every step (collectives and grouped
//!   send/recv), checked;
//! * `usr1`: rank 0, blocked in a receive rank 1 answers after 1 s, gets
//!   SIGUSR1 and dumps its flight record meanwhile;
//! * `scribble`: rank 1 turns hostile: for 3 s it writes random words over
//!   every shared memory it can write (its own mappings of memfds: the
//!   connections' segments, its flag segment) while it keeps calling; the
//!   others call AllReduces and AllToAlls between guard words and check
//!   them after every call, until one fails.
//!
//! Each rank prints `pid RANK PID` first, and `ok RANK` when MODE succeeded.

use std::process::ExitCode;
use std::time::Duration;

use collectives::bootstrap::{launch, LAUNCHER_VAR};
use collectives::{AsyncCommunicator, Communicator, DataType, ReduceOp};
use integration_tests::reference;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (ranks, mode) = match args.first().map(String::as_str) {
        Some("--ranks") => (args.get(1).and_then(|n| n.parse().ok()), &args[2..]),
        _ => (None, &args[..]),
    };
    if let (Some(n), None) = (ranks, std::env::var_os(LAUNCHER_VAR)) {
        let job = launch::Launch {
            nranks: n,
            program: std::env::current_exe().unwrap(),
            args: std::env::args_os().skip(1).collect(),
            env: Vec::new(),
            timeout: collectives::Config::from_env().unwrap().timeout,
            bind: launch::Bind::from_env().unwrap(),
        };
        let outcome = launch::run(&job).unwrap();
        for f in &outcome.failures {
            collectives::log::eprint_line(&format!("launcher: {f}"));
        }
        return if outcome.success() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    collectives::log::init();
    // The rank as any launcher tells it (RANK, Open MPI, MPICH, Slurm).
    let rank_env = collectives::Bootstrap::from_env().map_or(String::new(), |b| b.rank.to_string());
    println!("pid {rank_env} {}", std::process::id());
    match run(mode) {
        Ok(()) => {
            println!("ok {rank_env}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            collectives::log::eprint_line(&e);
            ExitCode::FAILURE
        }
    }
}

fn run(mode: &[String]) -> Result<(), String> {
    let name = mode.first().map(String::as_str).unwrap_or("");
    if name == "late" && collectives::Bootstrap::from_env().is_ok_and(|b| b.rank == 1) {
        let t = collectives::Config::from_env()?.timeout;
        std::thread::sleep(t + Duration::from_secs(2));
    }
    let mut comm = Communicator::from_env().map_err(|e| e.to_string())?;
    let e = |e: collectives::Error| e.to_string();
    let number =
        |i: usize, default: u64| mode.get(i).and_then(|v| v.parse().ok()).unwrap_or(default);
    match name {
        "elastic" => elastic(comm, number(1, 0), number(2, 200)),
        "matrix" => reference::run(&mut comm),
        "mismatch" => mismatch(
            &mut comm,
            mode.get(1).map(String::as_str).unwrap_or("count"),
        )
        .map_err(e),
        "die" | "stall" => victim(&mut comm, name == "die", 16 << 20).map_err(e),
        "die-small" => victim(&mut comm, true, 16).map_err(e),
        "late" => comm.barrier().map_err(e),
        "pingpong" => {
            let n: usize = mode.get(1).and_then(|n| n.parse().ok()).unwrap_or(10);
            let mut x = [comm.rank() as f32];
            for _ in 0..n {
                comm.all_reduce_in_place(&mut x, ReduceOp::Max).map_err(e)?;
            }
            Ok(())
        }
        "overlap" => overlap(comm).map_err(e),
        "rooted" => rooted(&mut comm),
        "stream" => stream(&mut comm),
        "group" => group(&mut comm),
        "pause" => pause(&mut comm),
        "skip" | "different" => odd_call(&mut comm, name == "skip").map_err(e),
        "usr1" => usr1(&mut comm).map_err(e),
        "scribble" => scribble(&mut comm),
        "behind" => behind(&mut comm).map_err(e),
        "group-die" => group_die(&mut comm),
        "split" => split(&mut comm),
        "abort" => abort(&mut comm),
        "mismatch-v" | "mismatch-p2p" => mismatch_new(&mut comm, name == "mismatch-v").map_err(e),
        other => Err(format!("unknown mode '{other}'")),
    }
}

/// Rank 0 broadcasts 4000 calls in a row, each of another length and
/// content, and every rank checks each: the root runs as far ahead as the
/// flag path's slots let it, and a slot it rewrote too early shows here.
fn stream(comm: &mut Communicator) -> Result<(), String> {
    let me = comm.rank();
    let value = |i: usize, j: usize| (i * 1000 + j) as i64;
    for i in 0..4000 {
        let len = 4 + i % 61;
        let mut buf: Vec<i64> = (0..len)
            .map(|j| if me == 0 { value(i, j) } else { -1 })
            .collect();
        comm.broadcast(&mut buf, 0).map_err(|e| e.to_string())?;
        if let Some(j) = (0..len).find(|&j| buf[j] != value(i, j)) {
            return Err(format!("broadcast {i}: element {j} is {}", buf[j]));
        }
    }
    comm.barrier().map_err(|e| e.to_string())
}

/// Broadcasts and Reduces in long runs, the root rotating and the data new
/// each call, with an AllReduce now and then: ranks that read little run
/// ahead of the others on the flag path (`tiny.rs`), and every result is
/// checked right after its call.
fn rooted(comm: &mut Communicator) -> Result<(), String> {
    let (me, n) = (comm.rank(), comm.size());
    let value = |i: usize, r: usize, j: usize| (i * 31 + r * 7 + j) as i64;
    let e = |e: collectives::Error| e.to_string();
    for i in 0..3000 {
        let root = (i / 3) % n;
        let len = 1 + i % 40;
        if i % 2 == 0 {
            let mut buf: Vec<i64> = (0..len)
                .map(|j| if me == root { value(i, root, j) } else { -1 })
                .collect();
            comm.broadcast(&mut buf, root).map_err(e)?;
            if let Some(j) = (0..len).find(|&j| buf[j] != value(i, root, j)) {
                return Err(format!(
                    "broadcast {i} from {root}: element {j} is {}",
                    buf[j]
                ));
            }
        } else {
            let send: Vec<i64> = (0..len).map(|j| value(i, me, j)).collect();
            let mut recv = vec![0i64; len];
            comm.reduce(&send, &mut recv, ReduceOp::Sum, root)
                .map_err(e)?;
            let want = |j| (0..n).map(|r| value(i, r, j)).sum::<i64>();
            if me == root {
                if let Some(j) = (0..len).find(|&j| recv[j] != want(j)) {
                    return Err(format!("reduce {i} to {root}: element {j} is {}", recv[j]));
                }
            }
        }
        if i % 500 == 499 {
            let mut x = [me as i64];
            comm.all_reduce_in_place(&mut x, ReduceOp::Sum).map_err(e)?;
            if x[0] != (n * (n - 1) / 2) as i64 {
                return Err(format!("allreduce after call {i}: {}", x[0]));
            }
        }
    }
    comm.barrier().map_err(e)
}

/// Every rank sends 64 MiB to the next and receives 64 MiB from the previous
/// one while an AllReduce runs: executed one call at a time in start order,
/// the sends would wait for receives that are never posted.
fn overlap(comm: Communicator) -> Result<(), collectives::Error> {
    let (n, me) = (comm.size(), comm.rank());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let comm = AsyncCommunicator::new(comm);
    let words = 16 << 20;
    for round in 0..3u32 {
        let sent = comm.send(vec![me as u32 + round; words], next);
        let reduced = comm.all_reduce(vec![1u32; 1000], ReduceOp::Sum);
        let got = comm.recv(vec![0u32; words], prev);
        let got = got.wait()?;
        assert!(
            got.iter().all(|v| *v == prev as u32 + round),
            "wrong data from rank {prev}"
        );
        assert!(reduced.wait()?.iter().all(|v| *v == n as u32));
        sent.wait()?;
    }
    Ok(())
}

fn group(comm: &mut Communicator) -> Result<(), String> {
    let e = |e: collectives::Error| e.to_string();
    let (n, me) = (comm.size(), comm.rank());
    // AllToAll, nccl-tests' way: a send and a receive per rank, itself included.
    let block = 1000;
    let send: Vec<u32> = (0..n * block)
        .map(|i| (me * 1_000_000 + i) as u32)
        .collect();
    let mut want = vec![0u32; n * block];
    comm.all_to_all(&send, &mut want).map_err(e)?;
    let mut got = vec![0u32; n * block];
    let mut g = comm.group();
    for (r, out) in got.chunks_mut(block).enumerate() {
        g.send(&send[r * block..(r + 1) * block], r).map_err(e)?;
        g.recv(out, r).map_err(e)?;
    }
    g.end().map_err(e)?;
    if got != want {
        return Err("grouped send/recv AllToAll differs from all_to_all".into());
    }
    // A ring exchange of 64 MiB: every rank sends before anyone receives.
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let out = vec![me as u64; 8 << 20];
    let mut inp = vec![0u64; 8 << 20];
    let mut g = comm.group();
    g.send(&out, next).map_err(e)?;
    g.recv(&mut inp, prev).map_err(e)?;
    g.end().map_err(e)?;
    if inp.iter().any(|v| *v != prev as u64) {
        return Err("ring exchange: wrong data".into());
    }
    // 100 small AllReduces fused, and one of another dtype, against one by one.
    let mut fused: Vec<Vec<f32>> = (0..100).map(|k| vec![(me + k) as f32; 1000 + k]).collect();
    let mut other = vec![me as i64; 7];
    let mut g = comm.group();
    for b in fused.iter_mut() {
        g.all_reduce_in_place(b, ReduceOp::Sum).map_err(e)?;
    }
    g.all_reduce_in_place(&mut other, ReduceOp::Max)
        .map_err(e)?;
    g.end().map_err(e)?;
    for (k, b) in fused.iter().enumerate() {
        let mut one = vec![(me + k) as f32; 1000 + k];
        comm.all_reduce_in_place(&mut one, ReduceOp::Sum)
            .map_err(e)?;
        if *b != one {
            return Err(format!("fused AllReduce {k} differs from its own call"));
        }
    }
    if other.iter().any(|v| *v != (n - 1) as i64) {
        return Err("the unfused AllReduce in the group is wrong".into());
    }
    // A lone send to oneself is an error at the end, and nothing moved.
    let mut g = comm.group();
    g.send(&out[..4], me).map_err(e)?;
    let err = g.end().expect_err("an unmatched send to oneself");
    if !err
        .to_string()
        .contains("sends itself 1 message(s) but receives 0")
    {
        return Err(format!("unexpected error: {err}"));
    }
    comm.barrier().map_err(e)
}

fn pause(comm: &mut Communicator) -> Result<(), String> {
    let e = |e: collectives::Error| e.to_string();
    let (n, me) = (comm.size(), comm.rank());
    let mut pids = vec![0u64; n];
    pids[me] = std::process::id() as u64;
    comm.all_reduce_in_place(&mut pids, ReduceOp::Max)
        .map_err(e)?;
    if me == 0 {
        let victim = rustix::process::Pid::from_raw(pids[1] as i32).unwrap();
        std::thread::spawn(move || {
            use rustix::process::{kill_process, Signal};
            std::thread::sleep(Duration::from_millis(500));
            kill_process(victim, Signal::STOP).unwrap();
            std::thread::sleep(Duration::from_secs(10));
            kill_process(victim, Signal::CONT).unwrap();
        });
    }
    let words = (256 << 20) / 4 / n * n;
    let send: Vec<u32> = (0..words).map(|i| (me * words + i) as u32).collect();
    let mut recv = vec![0u32; words];
    let block = words / n;
    // The same number of calls on every rank (a count from each rank's own
    // clock would make them disagree); the stop at 0.5 s falls among them.
    for _ in 0..30 {
        comm.all_to_all(&send, &mut recv).map_err(e)?;
    }
    for (j, b) in recv.chunks(block).enumerate() {
        if b.iter()
            .enumerate()
            .any(|(k, v)| *v != (j * words + me * block + k) as u32)
        {
            return Err(format!("block from rank {j} is wrong"));
        }
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb: u64 = (status.lines().find(|l| l.starts_with("VmHWM:")))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0);
    println!("peak {me} {}", kb * 1024);
    comm.barrier().map_err(e)
}

fn usr1(comm: &mut Communicator) -> Result<(), collectives::Error> {
    comm.barrier()?;
    let mut x = [0u32; 4];
    match comm.rank() {
        0 => {
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                let me = rustix::process::getpid();
                rustix::process::kill_process(me, rustix::process::Signal::USR1).unwrap();
            });
            comm.recv(&mut x, 1)?;
        }
        1 => {
            std::thread::sleep(Duration::from_secs(1));
            comm.send(&[7u32; 4], 0)?;
        }
        _ => {}
    }
    comm.barrier()
}

/// Rank 1 is busy (outside any call) until after the others' timeout.
fn behind(comm: &mut Communicator) -> Result<(), collectives::Error> {
    comm.barrier()?;
    if comm.rank() == 1 {
        std::thread::sleep(comm.config().timeout * 3);
    }
    let mut x = vec![1.0f32; 1000];
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum)
}

/// Rank 1 skips the AllReduce the others make (its Broadcast meets their
/// AllReduce), or calls an AllGather in its place.
fn odd_call(comm: &mut Communicator, skip: bool) -> Result<(), collectives::Error> {
    let n = comm.size();
    comm.barrier()?;
    let mut x = vec![1.0f32; 1000 * n];
    match (comm.rank(), skip) {
        (1, true) => {}
        (1, false) => {
            let mine = x[..1000].to_vec();
            comm.all_gather(&mine, &mut x)?;
        }
        _ => comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?,
    }
    comm.broadcast(&mut x[..10], 0)
}

/// Rank 1 leaves; the others' group (a ring exchange) fails at its end,
/// naming it.
fn group_die(comm: &mut Communicator) -> Result<(), String> {
    let (n, me) = (comm.size(), comm.rank());
    comm.barrier().map_err(|e| e.to_string())?;
    if me == 1 {
        std::process::exit(0);
    }
    let out = vec![1u8; 1 << 20];
    let mut inp = vec![0u8; 1 << 20];
    let mut g = comm.group();
    g.send(&out, (me + 1) % n).map_err(|e| e.to_string())?;
    g.recv(&mut inp, (me + n - 1) % n)
        .map_err(|e| e.to_string())?;
    g.end().map_err(|e| e.to_string())
}

/// The parent and two children (even and odd ranks) used at once, each from
/// its own thread.
fn split(comm: &mut Communicator) -> Result<(), String> {
    let e = |e: collectives::Error| e.to_string();
    let (n, me) = (comm.size(), comm.rank());
    let color = (me % 2) as u32;
    // Keys reverse the order: the child's rank 0 is the highest parent rank.
    let mut child = comm
        .split(Some(color), -(me as i64))
        .map_err(e)?
        .ok_or("no child")?;
    let members: Vec<usize> = (0..n).filter(|r| r % 2 == me % 2).collect();
    let want_rank = members.len() - 1 - members.iter().position(|r| *r == me).unwrap();
    if child.size() != members.len() || child.rank() != want_rank {
        return Err(format!(
            "child of color {color}: rank {} of {}, expected {want_rank} of {}",
            child.rank(),
            child.size(),
            members.len()
        ));
    }
    let none = comm.split(None, 0).map_err(e)?;
    if none.is_some() {
        return Err("a rank that opted out got a communicator".into());
    }
    let want_child: f64 = members.iter().map(|r| *r as f64).sum();
    let worker = std::thread::spawn(move || -> Result<(), String> {
        for _ in 0..50 {
            let mut x = vec![me as f64; 4099];
            child
                .all_reduce_in_place(&mut x, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            if x.iter().any(|v| *v != want_child) {
                return Err(format!("child sum {} != {want_child}", x[0]));
            }
        }
        child.barrier().map_err(|e| e.to_string())
    });
    let want_parent: f64 = (0..n).map(|r| r as f64).sum();
    for _ in 0..50 {
        let mut x = vec![me as f64; 4099];
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum).map_err(e)?;
        if x.iter().any(|v| *v != want_parent) {
            return Err(format!("parent sum {} != {want_parent}", x[0]));
        }
    }
    worker.join().map_err(|_| "child thread panicked")??;
    comm.barrier().map_err(e)
}

/// Rank 0 blocks in a receive that never completes; a second thread aborts
/// it. Prints how each rank's blocked call ended, and how a call with
/// nothing to move (which returns without a transfer) ended after, for the
/// test to check. Such a call with a root that is no rank fails at once.
fn abort(comm: &mut Communicator) -> Result<(), String> {
    let no_root = comm.broadcast::<f32>(&mut [], comm.size());
    let e = no_root.expect_err("an empty broadcast from no rank must fail");
    println!(
        "rank {} empty call with no root: {:?}: {e}",
        comm.rank(),
        e.kind()
    );
    comm.barrier().map_err(|e| e.to_string())?;
    let started = std::time::Instant::now();
    let result = if comm.rank() == 0 {
        let handle = comm.abort_handle();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            handle.abort("stopped by the test's watchdog");
        });
        let mut buf = [0u8; 8];
        comm.recv(&mut buf, 1)
    } else {
        comm.barrier()
    };
    let e = result.expect_err("the blocked call must fail");
    let empty = comm.broadcast::<f32>(&mut [], 0);
    println!(
        "rank {} ended after {:.1}s with {:?}: {e}; an empty call after: {:?}",
        comm.rank(),
        started.elapsed().as_secs_f64(),
        e.kind(),
        empty.map_err(|e| e.kind())
    );
    Ok(())
}

/// Rank 1 expects 5 elements where rank 0 sends 4 (AllToAllv or send/recv).
fn mismatch_new(comm: &mut Communicator, v: bool) -> Result<(), collectives::Error> {
    comm.barrier()?;
    let (n, me) = (comm.size(), comm.rank());
    if v {
        let mut recv_counts = vec![4; n];
        if me == 1 {
            recv_counts[0] = 5;
        }
        let counts = collectives::VarCounts::packed(&vec![4; n], &recv_counts);
        let send = vec![1f32; 4 * n];
        let mut recv = vec![0f32; counts.total_received()];
        comm.all_to_all_v(&send, &mut recv, &counts)
    } else {
        match me {
            0 => comm.send(&[1f32; 4], 1),
            1 => comm.recv(&mut [0f32; 5], 0),
            _ => Ok(()),
        }
    }
}

/// Rank 1 disagrees with the others on one property of an allreduce.
fn mismatch(comm: &mut Communicator, kind: &str) -> Result<(), collectives::Error> {
    let odd = comm.rank() == 1;
    comm.barrier()?;
    let mut buf = vec![0u8; 4096];
    if kind == "root" {
        // Rank 1 takes itself for the root: each root could finish alone.
        let root = if odd { 1 } else { 0 };
        comm.broadcast(&mut buf[..256], root)?;
        return comm.barrier();
    }
    if kind == "roots" {
        // The same, in a loop with nothing that reads every rank: only the
        // check before a slot is reused can tell.
        for _ in 0..1000 {
            comm.broadcast(&mut buf[..8], if odd { 1 } else { 0 })?;
        }
        return Ok(());
    }
    let (len, dtype, op) = match kind {
        "count" if odd => (4092, DataType::F32, ReduceOp::Sum),
        "dtype" if odd => (4096, DataType::I32, ReduceOp::Sum),
        "op" if odd => (4096, DataType::F32, ReduceOp::Max),
        _ => (4096, DataType::F32, ReduceOp::Sum),
    };
    comm.all_reduce_bytes(collectives::Buffers::InPlace(&mut buf[..len]), dtype, op)
}

/// AllReduces of `count` floats in a loop; rank 1 is stopped or killed
/// during one.
fn victim(comm: &mut Communicator, kill: bool, count: usize) -> Result<(), collectives::Error> {
    let mut buf = vec![1.0f32; count];
    comm.barrier()?;
    if comm.rank() == 1 {
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let sig = if kill {
                rustix::process::Signal::KILL
            } else {
                rustix::process::Signal::STOP
            };
            rustix::process::kill_process(rustix::process::getpid(), sig).unwrap();
        });
    }
    let calls = if count < 1024 { 100_000_000 } else { 1000 };
    for _ in 0..calls {
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
    }
    Ok(())
}

/// A small deterministic mix (splitmix64), the same on every rank.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Guard words on each side of every buffer of `scribble`.
const GUARD: usize = 16;
const GUARD_WORD: f32 = -7.25;

/// `scribble` (see the header). An honest rank returns the error its calls
/// ended with, or says that guard words changed.
fn scribble(comm: &mut Communicator) -> Result<(), String> {
    let rank = comm.rank();
    // Connections and the flag path up and used first.
    for count in [1usize, 1000, 40_000] {
        let mut x = vec![1f32; count];
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
    }
    // Rank 1 makes the same calls (no disagreement to catch), scribbling.
    let until = std::time::Instant::now() + Duration::from_secs(3);
    if rank == 1 {
        std::thread::spawn(move || scribble_until(until));
    }
    let guarded = |count: usize| vec![GUARD_WORD; count + 2 * GUARD];
    let intact = |b: &[f32]| {
        let n = b.len();
        b[..GUARD]
            .iter()
            .chain(&b[n - GUARD..])
            .all(|w| *w == GUARD_WORD)
    };
    for call in 0u64.. {
        if rank == 1 && std::time::Instant::now() > until {
            println!("ok 1");
            // Not through main: its communicator is in no state to be dropped.
            std::process::exit(0);
        }
        let count = [1, 7, 1000, 16_384, 300_000][(call % 5) as usize];
        let (mut a, mut b) = (guarded(count * comm.size()), guarded(count * comm.size()));
        let n = a.len();
        a[GUARD..n - GUARD].fill(1.0);
        let result = match call % 2 {
            0 => comm.all_reduce_in_place(&mut a[GUARD..n - GUARD], ReduceOp::Sum),
            _ => comm.all_to_all(&a[GUARD..n - GUARD], &mut b[GUARD..n - GUARD]),
        };
        if rank == 1 {
            continue;
        }
        if !intact(&a) || !intact(&b) {
            return Err(format!(
                "rank {rank}: guard words around call {call}'s buffers changed"
            ));
        }
        result.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Writes random words, and words a descriptor might hold at its limits,
/// at random places of every shared mapping of a memfd this process can
/// write, over and over until `until`.
fn scribble_until(until: std::time::Instant) {
    let mut x = unix_us() as u64;
    let extremes = [
        0,
        1,
        u64::MAX,
        u64::MAX / 2 + 1,
        u32::MAX as u64,
        4096,
        1 << 40,
    ];
    while std::time::Instant::now() < until {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        for line in maps.lines().filter(|l| l.contains("memfd:")) {
            let mut fields = line.split_whitespace();
            let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
                continue;
            };
            let Some((lo, hi)) = range.split_once('-') else {
                continue;
            };
            let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            else {
                continue;
            };
            if !perms.starts_with("rw") || !perms.ends_with('s') {
                continue;
            }
            for _ in 0..64 {
                x = mix(x);
                let at = lo + (x as usize % (hi - lo)) / 8 * 8;
                let word = match x >> 61 {
                    0..=3 => mix(x),
                    k => extremes[(mix(x) % extremes.len() as u64) as usize] ^ (k & 1),
                };
                // SAFETY: none. This is the hostile rank: it writes into its
                // own shared mappings (found in /proc/self/maps, writable,
                // 8-aligned inside) under its library's feet, on purpose.
                unsafe { (at as *mut u64).write_volatile(word) };
            }
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// `elastic SEED STEPS`: the seed picks one or two victims, each of which
/// SIGKILLs itself at a random moment (0-3 ms into a step between a tenth and
/// three fifths of the way; a moment in time instead came after the last
/// step once calls got faster, and nobody died); every rank runs STEPS
/// checked collectives (kind and size by step), and on a failure agrees on
/// the failed ranks, shrinks, and resumes at the earliest step any survivor
/// had not finished. Prints `shrunk ORIG failed [..] size N ms T` per shrink
/// and `done ORIG size N failed [..]` at the end (original ranks).
fn elastic(mut comm: Communicator, seed: u64, steps: u64) -> Result<(), String> {
    let me = comm.rank();
    let n0 = comm.size();
    let victims: Vec<usize> = {
        let first = (mix(seed) % n0 as u64) as usize;
        let second = (mix(seed + 1) % n0 as u64) as usize;
        match mix(seed + 2).is_multiple_of(2) || second == first {
            true => vec![first],
            false => vec![first, second],
        }
    };
    // Some jobs lose their second victim during the recovery from the
    // first: it dies as it enters the agreement.
    let dies_in_recovery = victims.len() == 2 && seed % 5 == 4 && me == victims[1];
    let mut kill_at = (victims.iter().position(|v| *v == me && !dies_in_recovery)).map(|k| {
        let k = k as u64;
        let step = steps / 10 + mix(seed + 3 + k) % (steps / 2).max(1);
        (step, Duration::from_micros(mix(seed + 7 + k) % 3000))
    });
    let mut members: Vec<usize> = (0..n0).collect();
    let mut failed_all: Vec<usize> = Vec::new();
    // Each failure (in a step, in the resync after a shrink, in the final
    // barrier) leads to an agreement and a shrink, then a resync.
    let (mut step, mut resync, mut done) = (0, false, false);
    while !done {
        let attempt = if resync {
            // Resume where the slowest survivor was.
            let mut at = [step];
            let r = comm.all_reduce_in_place(&mut at, ReduceOp::Min);
            r.map(|()| (step, resync) = (at[0], false))
                .map_err(|e| e.to_string())
        } else if step < steps {
            if let Some((_, delay)) = kill_at.filter(|(at, _)| *at == step) {
                kill_at = None;
                std::thread::spawn(move || {
                    std::thread::sleep(delay);
                    die();
                });
            }
            elastic_step(&mut comm, seed, step, &members).map(|()| step += 1)
        } else {
            comm.barrier()
                .map(|()| done = true)
                .map_err(|e| e.to_string())
        };
        let Err(failure) = attempt else { continue };
        if dies_in_recovery {
            die();
        }
        let t = std::time::Instant::now();
        let (new, failed) = loop {
            let failed = comm.failed_ranks().map_err(|e| e.to_string())?;
            match comm.shrink(&failed, false) {
                Ok(new) => break (new, failed),
                // A rank died during the shrink: agree again.
                Err(e) => collectives::log::eprint_line(&format!("rank {me}: {e}; agreeing again")),
            }
        };
        failed_all.extend(failed.iter().map(|r| members[*r]));
        failed_all.sort();
        members = (0..members.len())
            .filter(|r| !failed.contains(r))
            .map(|r| members[r])
            .collect();
        comm = new;
        resync = true;
        println!(
            "shrunk {me} failed {failed_all:?} size {} ms {} at {} after: {failure}",
            comm.size(),
            t.elapsed().as_millis(),
            unix_us()
        );
    }
    println!("done {me} size {} failed {failed_all:?}", comm.size());
    Ok(())
}

/// Microseconds since the Unix epoch (the ranks share a clock).
fn unix_us() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros()
}

/// SIGKILLs this process, saying when first (`dying AT`).
fn die() {
    println!("dying {}", unix_us());
    let me = rustix::process::getpid();
    rustix::process::kill_process(me, rustix::process::Signal::KILL).unwrap();
}

/// One checked collective: its kind and size follow from the step; each
/// member's data from its original rank, so results are known exactly.
fn elastic_step(
    comm: &mut Communicator,
    seed: u64,
    step: u64,
    members: &[usize],
) -> Result<(), String> {
    let h = mix(seed ^ (step << 20));
    let count = [1usize, 7, 1000, 65536][(h % 4) as usize];
    let (n, r) = (comm.size(), comm.rank());
    let value = |orig: usize, i: usize| ((orig * 31 + i + step as usize) % 1000) as f32;
    let e = |e: collectives::Error| e.to_string();
    let wrong = |what: &str| Err(format!("step {step}: {what} is wrong"));
    match (h >> 8) % 4 {
        0 => {
            let mut x: Vec<f32> = (0..count).map(|i| value(members[r], i)).collect();
            comm.all_reduce_in_place(&mut x, ReduceOp::Sum).map_err(e)?;
            let ok = (0..count).all(|i| x[i] == members.iter().map(|m| value(*m, i)).sum::<f32>());
            if !ok {
                return wrong("allreduce");
            }
        }
        1 => {
            let send: Vec<f32> = (0..count * n).map(|i| value(members[r], i)).collect();
            let mut recv = vec![0f32; count * n];
            comm.all_to_all(&send, &mut recv).map_err(e)?;
            let ok = (0..n).all(|j| {
                (0..count).all(|i| recv[j * count + i] == value(members[j], r * count + i))
            });
            if !ok {
                return wrong("alltoall");
            }
        }
        2 => {
            // A group: send to the next rank, receive from the previous.
            let out: Vec<f32> = (0..count).map(|i| value(members[r], i)).collect();
            let mut inp = vec![0f32; count];
            let mut g = comm.group();
            g.send(&out, (r + 1) % n).map_err(e)?;
            g.recv(&mut inp, (r + n - 1) % n).map_err(e)?;
            g.end().map_err(e)?;
            if (0..count).any(|i| inp[i] != value(members[(r + n - 1) % n], i)) {
                return wrong("grouped send/recv");
            }
        }
        _ => {
            let mine: Vec<f32> = (0..count).map(|i| value(members[r], i)).collect();
            let mut all = vec![0f32; count * n];
            comm.all_gather(&mine, &mut all).map_err(e)?;
            let ok = (0..n).all(|j| (0..count).all(|i| all[j * count + i] == value(members[j], i)));
            if !ok {
                return wrong("allgather");
            }
        }
    }
    Ok(())
}
