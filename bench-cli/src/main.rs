//! collbench: measures collectives the way nccl-tests does. With `-n N` it
//! starts N ranks of itself on this host; under a launcher (mpirun,
//! torchrun-style variables) each process is one rank.

mod cli;
mod commands;
mod launch;
mod report;
mod settings;
mod sweep;

use std::process::ExitCode;

use clap::Parser;
use collectives::algo::ALGORITHMS;
use collectives::Collective;

use cli::{Cli, Command};
use collectives::bootstrap::under_launcher;
use commands::{simulate, trace, tune};
use launch::launch_local;
use report::plot;
use sweep::run_rank;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (collective, args) = match cli.command {
        Command::Tune(t) => {
            collectives::log::init();
            let result = match t.bench.nranks {
                Some(n) if !under_launcher() => launch_local(Collective::AllReduce, n, &t.bench),
                _ => tune::run_rank(&t).map(|()| 0),
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
        Some(n) if !under_launcher() => launch_local(collective, n, &args),
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
pub(crate) const WRONG_VALUES: u8 = 1;
/// Exit status when a rank failed.
pub(crate) const FAILED: u8 = 2;
