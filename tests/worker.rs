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
//! * `pingpong N`: N small allreduces (for jobs started by hand).
//!
//! Each rank prints `pid RANK PID` first, and `ok RANK` when MODE succeeded.

use std::process::ExitCode;
use std::time::Duration;

use collectives::bootstrap::{launch, LAUNCHER_VAR};
use collectives::{Communicator, DataType, ReduceOp};
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
    match name {
        "matrix" => reference::run(&mut comm),
        "mismatch" => mismatch(
            &mut comm,
            mode.get(1).map(String::as_str).unwrap_or("count"),
        )
        .map_err(e),
        "die" | "stall" => victim(&mut comm, name == "die").map_err(e),
        "late" => comm.barrier().map_err(e),
        "pingpong" => {
            let n: usize = mode.get(1).and_then(|n| n.parse().ok()).unwrap_or(10);
            let mut x = [comm.rank() as f32];
            for _ in 0..n {
                comm.all_reduce_in_place(&mut x, ReduceOp::Max).map_err(e)?;
            }
            Ok(())
        }
        other => Err(format!("unknown mode '{other}'")),
    }
}

/// Rank 1 disagrees with the others on one property of an allreduce.
fn mismatch(comm: &mut Communicator, kind: &str) -> Result<(), collectives::Error> {
    let odd = comm.rank() == 1;
    comm.barrier()?;
    let mut buf = vec![0u8; 4096];
    let (len, dtype, op) = match kind {
        "count" if odd => (4092, DataType::F32, ReduceOp::Sum),
        "dtype" if odd => (4096, DataType::I32, ReduceOp::Sum),
        "op" if odd => (4096, DataType::F32, ReduceOp::Max),
        _ => (4096, DataType::F32, ReduceOp::Sum),
    };
    comm.all_reduce_bytes(collectives::Buffers::InPlace(&mut buf[..len]), dtype, op)
}

/// Large allreduces in a loop; rank 1 is stopped or killed during one.
fn victim(comm: &mut Communicator, kill: bool) -> Result<(), collectives::Error> {
    let mut buf = vec![1.0f32; 16 << 20];
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
    for _ in 0..1000 {
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
    }
    Ok(())
}
