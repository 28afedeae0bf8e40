//! Shared code of the integration tests: the correctness matrix (reference.rs) each rank of
//! `coll-worker matrix` runs, and helpers for the test files.

pub mod reference;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// A finished command with its output as text.
pub struct Run {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

/// Runs `program args` with extra environment, waiting at most `limit`.
pub fn run(program: &Path, args: &[&str], env: &[(&str, &str)], limit: Duration) -> Run {
    let start = Instant::now();
    let mut cmd = Command::new(program);
    cmd.args(args).envs(env.iter().copied());
    // Variables a developer's shell might carry would change the job's shape.
    for v in [
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "COLL_LAUNCHER",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
    ] {
        if !env.iter().any(|(k, _)| *k == v) {
            cmd.env_remove(v);
        }
    }
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
    let pid = child.id();
    let watchdog = std::thread::spawn(move || {
        let until = Instant::now() + limit;
        while Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50));
            if !Path::new(&format!("/proc/{pid}")).exists() {
                return;
            }
        }
        if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    });
    let Output {
        status,
        stdout,
        stderr,
    } = child.wait_with_output().unwrap();
    let _ = watchdog.join();
    let r = Run {
        ok: status.success(),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
        elapsed: start.elapsed(),
    };
    assert!(
        r.elapsed < limit,
        "{} {args:?} did not finish within {limit:?}\nstdout:\n{}\nstderr:\n{}",
        program.display(),
        r.stdout,
        r.stderr
    );
    r
}

/// The pids the worker's ranks printed (`pid RANK PID` lines).
pub fn worker_pids(stdout: &str) -> Vec<u32> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("pid "))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect()
}

/// Whether a process still exists (and is not a zombie awaiting its parent).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

/// A TCP port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
