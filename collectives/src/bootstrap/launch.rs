//! The local launcher: runs N ranks of a program on this host, hosts their
//! rendezvous, and makes sure none outlives the job.

use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use super::rendezvous::Server;
use super::{random_token, LAUNCHER_VAR, TOKEN_VAR};

/// What to launch.
#[derive(Clone, Debug)]
pub struct Launch {
    pub nranks: usize,
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
    /// The ranks' own timeout: after a rank fails, the others get this long
    /// (plus a margin) to notice and exit before they are killed.
    pub timeout: Duration,
    /// Whether rank i is bound to the i-th allowed core.
    pub bind: Bind,
}

/// How the local launcher places ranks: `Core` binds rank i to the i-th
/// CPU this process may use (when there are enough), `None` leaves them to
/// the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bind {
    Core,
    None,
}

impl Bind {
    /// Measured on 2 cores, 2 ranks, AllReduce over shared memory (medians
    /// of 3, time per call), bound vs unbound: idle, the same (8 B 0.31 vs
    /// 0.31 us, 1 MiB 72 vs 108 us); with a busy loop pinned to core 1,
    /// bound 8 B 0.33 us, 4 KiB 1.5, 1 MiB 181, 16 MiB 5637; unbound 2.5,
    /// 3.1, 247, 4756: the scheduler puts both unbound ranks on the free
    /// core, where each call waits for a switch between them, while a bound
    /// rank sharing its core with the busy loop gets half of it in long
    /// slices. (Before a bound rank spun instead of yielding, bound was the
    /// collapse: 2000 us at 8 B.)
    pub const DEFAULT: Bind = Bind::Core;

    /// `core` or `none`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "core" => Ok(Bind::Core),
            "none" => Ok(Bind::None),
            other => Err(format!("bind '{other}': use core or none")),
        }
    }

    /// `COLL_BIND`, else [`Bind::DEFAULT`].
    pub fn from_env() -> Result<Self, String> {
        match std::env::var("COLL_BIND") {
            Ok(v) => Self::parse(&v).map_err(|e| format!("COLL_BIND: {e}")),
            Err(_) => Ok(Self::DEFAULT),
        }
    }
}

/// How a finished job went: one line per rank that failed, empty if none did.
#[derive(Debug, Default)]
pub struct Outcome {
    pub failures: Vec<String>,
    /// The largest exit status of a failed rank; 255 for a rank that died of
    /// a signal or was killed by the launcher.
    pub worst_status: u8,
}

impl Outcome {
    pub fn success(&self) -> bool {
        self.failures.is_empty()
    }

    fn failed(&mut self, line: String, status: u8) {
        self.failures.push(line);
        self.worst_status = self.worst_status.max(status);
    }
}

/// Starts the ranks and waits for all of them. A rank that fails starts a
/// grace period after which the survivors are killed; every child is reaped
/// before this returns, and each dies with us if we die (PR_SET_PDEATHSIG).
pub fn run(job: &Launch) -> Result<Outcome, String> {
    let server = Server::bind("127.0.0.1:0".parse().unwrap())?;
    let port = server.local_addr().port();
    let token = random_token();
    // A job of one has nobody to meet: its rank skips the rendezvous.
    let rendezvous = (job.nranks > 1)
        .then(|| server.spawn(Some(job.nranks), token, Instant::now() + job.timeout));
    let cores = (job.bind == Bind::Core)
        .then(|| core_plan(job.nranks))
        .flatten();
    let mut children = Vec::with_capacity(job.nranks);
    for rank in 0..job.nranks {
        match spawn_rank(job, rank, port, token, cores.as_ref().map(|c| c[rank])) {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                kill_all(&mut children);
                return Err(format!(
                    "cannot start rank {rank} ({}): {e}",
                    job.program.display()
                ));
            }
        }
    }
    let outcome = supervise(&mut children, job.timeout + Duration::from_secs(10));
    if let Some(Ok(Err(e))) = rendezvous.map(|r| r.join()) {
        tracing::debug!("rendezvous: {e}");
    }
    Ok(outcome)
}

/// The core each rank is bound to with [`Bind::Core`]: the i-th CPU this
/// process may use for rank i, as mpirun binds by default. `None` when
/// ranks outnumber cores (the scheduler must juggle them). Binding them in
/// blocks of neighbours (8 ranks on 2 cores: 0-3 on the first) was tried:
/// idle it kept Rabenseifner's largest halves in one core's caches (4-rank
/// AllReduce of 1 MiB in place 0.92x the time, 8 ranks in the ~500 ns
/// minutes 0.57x; 4-rank Reduce of 1 MiB 1.19x), but with a busy loop on
/// one core the ranks bound beside it starved the rest: 4-rank AllReduce of
/// 8 B 381x, of 1 MiB 5.2x, Broadcast of 1 MiB 11.7x (`ci/ab.py ... --busy`).
fn core_plan(nranks: usize) -> Option<Vec<usize>> {
    let allowed = rustix::thread::sched_getaffinity(None).ok()?;
    let cpus: Vec<usize> = (0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|c| allowed.is_set(*c))
        .collect();
    (nranks <= cpus.len()).then(|| cpus[..nranks].to_vec())
}

fn spawn_rank(
    job: &Launch,
    rank: usize,
    port: u16,
    token: u128,
    core: Option<usize>,
) -> std::io::Result<Child> {
    let mut cmd = Command::new(&job.program);
    cmd.args(&job.args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", job.nranks.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", job.nranks.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env(TOKEN_VAR, format!("{token:032x}"))
        .env(LAUNCHER_VAR, "1")
        .envs(job.env.iter().map(|(k, v)| (k, v)));
    let mut cpus = rustix::thread::CpuSet::new();
    if let Some(c) = core {
        cpus.set(c);
    }
    // SAFETY: the closure runs in the forked child before exec and makes only
    // async-signal-safe system calls (prctl, sched_setaffinity).
    unsafe {
        cmd.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
            if core.is_some() {
                rustix::thread::sched_setaffinity(None, &cpus)?;
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// Waits for every child; once one fails, the rest get `grace` to exit.
fn supervise(children: &mut [Option<Child>], grace: Duration) -> Outcome {
    let mut outcome = Outcome::default();
    let mut failed_at: Option<Instant> = None;
    while children.iter().any(Option::is_some) {
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            if let Ok(Some(status)) = child.try_wait() {
                if !status.success() {
                    let code = status.code().map_or(255, |c| c.clamp(1, 255) as u8);
                    outcome.failed(describe(rank, status), code);
                    failed_at.get_or_insert_with(Instant::now);
                }
                *slot = None;
            }
        }
        if failed_at.is_some_and(|t| t.elapsed() > grace) {
            for (rank, slot) in children.iter().enumerate() {
                if slot.is_some() {
                    let line = format!(
                        "rank {rank} was still running {}s after the first failure and was killed",
                        grace.as_secs()
                    );
                    outcome.failed(line, 255);
                }
            }
            kill_all(children);
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    outcome
}

fn kill_all(children: &mut [Option<Child>]) {
    for child in children.iter_mut().flatten() {
        let _ = child.kill();
        let _ = child.wait();
    }
    children.iter_mut().for_each(|c| *c = None);
}

fn describe(rank: usize, status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("rank {rank} exited with status {code}"),
        (None, Some(sig)) => format!("rank {rank} was killed by signal {sig}{}", signal_name(sig)),
        _ => format!("rank {rank} ended: {status}"),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        6 => " (SIGABRT)",
        9 => " (SIGKILL)",
        11 => " (SIGSEGV)",
        15 => " (SIGTERM)",
        _ => "",
    }
}
