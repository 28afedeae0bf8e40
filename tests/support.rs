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

/// The binary `name` built beside `worker` (the coll-worker a test knows),
/// as a string for command lines.
pub fn sibling(worker: &str, name: &str) -> String {
    let p = Path::new(worker).with_file_name(name);
    assert!(
        p.exists(),
        "{} is missing: build the workspace first (cargo build --release)",
        p.display()
    );
    p.to_string_lossy().into_owned()
}

/// A collbench run succeeded with no wrong value.
pub fn assert_clean(r: &Run, what: &str) {
    assert!(r.ok, "{what} failed:\n{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains("# Out of bounds values : 0 OK"),
        "{what}:\n{}",
        r.stdout
    );
}

/// Runs `program args` with extra environment, waiting at most `limit`.
pub fn run(program: &Path, args: &[&str], env: &[(&str, &str)], limit: Duration) -> Run {
    let start = Instant::now();
    let mut cmd = Command::new(program);
    cmd.args(args).envs(env.iter().copied());
    // Variables a developer's shell might carry would change the job's shape.
    let shape = ["WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "COLL_LAUNCHER"];
    for v in shape.into_iter().chain(collectives::bootstrap::RANK_VARS) {
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

/// A loopback port nobody listens on, held for as long as the returned socket
/// lives: bound but not listening, so a connection to it is refused and no
/// other socket (another test's listener on an ephemeral port) can take it.
pub fn closed_port() -> (rustix::fd::OwnedFd, u16) {
    use rustix::net::{bind, getsockname, socket, AddressFamily, SocketAddrV4, SocketType};
    let sock = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    bind(&sock, &SocketAddrV4::new([127, 0, 0, 1].into(), 0)).unwrap();
    let port = std::net::SocketAddr::try_from(getsockname(&sock).unwrap())
        .unwrap()
        .port();
    (sock, port)
}

/// A TCP port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Network namespaces standing in for hosts: `count` namespaces joined by a
/// bridge in the first (veth pairs to it), addresses 10.77.0.(i+1)/24,
/// each with its own /etc/hosts (so names resolve) and, for launchers, an
/// "ssh" agent that enters a namespace under its name as hostname. Removed
/// again on drop.
pub struct Hosts {
    pub names: Vec<String>,
    pub agent: std::path::PathBuf,
    tag: String,
}

impl Hosts {
    /// `None` (with the reason printed) where namespaces cannot be made:
    /// not root, no iproute2, no CAP_NET_ADMIN. With COLL_REQUIRE_NETNS=1
    /// that is a failure instead.
    pub fn new(count: usize) -> Option<Self> {
        // Unique per process and fixture: tests run in parallel.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!("{}x{n}", std::process::id() % 100_000);
        let names: Vec<String> = (0..count).map(|i| format!("coll{tag}h{i}")).collect();
        let hosts = Hosts {
            agent: std::env::temp_dir().join(format!("coll-nsagent-{tag}.sh")),
            names,
            tag,
        };
        match hosts.create() {
            Ok(()) => Some(hosts),
            Err(why) => {
                drop(hosts);
                let required = std::env::var("COLL_REQUIRE_NETNS").is_ok_and(|v| v == "1");
                assert!(
                    !required,
                    "cannot create network namespaces ({why}), and COLL_REQUIRE_NETNS=1"
                );
                eprintln!("skipping: cannot create network namespaces: {why}");
                None
            }
        }
    }

    /// The address of host `i`.
    pub fn ip(&self, i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// Runs `cmd` as `per_host` ranks on each host, torchrun-style (RANK,
    /// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR on host 0); each rank's run, by rank.
    pub fn torchrun(&self, per_host: usize, port: u16, cmd: &str) -> Vec<Run> {
        let size = per_host * self.names.len();
        let master = self.ip(0);
        let job = |rank: usize| {
            let cmd = format!(
                "env RANK={rank} WORLD_SIZE={size} LOCAL_RANK={} MASTER_ADDR={master} MASTER_PORT={port} {cmd}",
                rank % per_host
            );
            let args = self.exec_args(rank / per_host, &cmd);
            move || {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                run(Path::new("ip"), &args, &[], Duration::from_secs(300))
            }
        };
        let others: Vec<_> = (1..size).map(|r| std::thread::spawn(job(r))).collect();
        let mut runs = vec![job(0)()];
        runs.extend(others.into_iter().map(|o| o.join().unwrap()));
        runs
    }

    fn create(&self) -> Result<(), String> {
        let ip = |args: &[&str]| -> Result<(), String> {
            let out = Command::new("ip")
                .args(args)
                .output()
                .map_err(|e| format!("ip: {e}"))?;
            match out.status.success() {
                true => Ok(()),
                false => Err(format!(
                    "ip {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr).trim()
                )),
            }
        };
        let hosts_file: String = std::iter::once("127.0.0.1 localhost\n".to_string())
            .chain(
                self.names
                    .iter()
                    .enumerate()
                    .map(|(i, n)| format!("{} {n}\n", self.ip(i))),
            )
            .collect();
        for (i, name) in self.names.iter().enumerate() {
            ip(&["netns", "add", name])?;
            ip(&["-n", name, "link", "set", "lo", "up"])?;
            let dir = format!("/etc/netns/{name}");
            std::fs::create_dir_all(&dir).map_err(|e| format!("{dir}: {e}"))?;
            std::fs::write(format!("{dir}/hosts"), &hosts_file)
                .map_err(|e| format!("{dir}/hosts: {e}"))?;
            // Host 0 holds the switch: a bridge carrying its own address,
            // and one veth pair to each other host (so any two hosts talk
            // directly, as on a switched network).
            let bridge = format!("b{}", self.tag);
            let with_cidr = format!("{}/24", self.ip(i));
            if i == 0 {
                ip(&["-n", name, "link", "add", &bridge, "type", "bridge"])?;
                ip(&["-n", name, "addr", "add", &with_cidr, "dev", &bridge])?;
                ip(&["-n", name, "link", "set", &bridge, "up"])?;
                continue;
            }
            // Named from the whole tag: interface names hold 15 bytes.
            let (a, b) = (format!("v{}a{i}", self.tag), format!("v{}b{i}", self.tag));
            let host0 = &self.names[0];
            ip(&["link", "add", &a, "type", "veth", "peer", "name", &b])?;
            ip(&["link", "set", &a, "netns", host0])?;
            ip(&["link", "set", &b, "netns", name])?;
            ip(&["-n", host0, "link", "set", &a, "master", &bridge])?;
            ip(&["-n", name, "addr", "add", &with_cidr, "dev", &b])?;
            ip(&["-n", host0, "link", "set", &a, "up"])?;
            ip(&["-n", name, "link", "set", &b, "up"])?;
        }
        let agent = "#!/bin/sh\n# ssh stand-in: [ssh options] HOST COMMAND... runs COMMAND in namespace HOST, hostname HOST\n\
                     while [ \"${1#-}\" != \"$1\" ]; do shift; done\nhost=$1; shift\n\
                     exec ip netns exec \"$host\" unshare --uts sh -c \"hostname $host; $*\"\n";
        std::fs::write(&self.agent, agent).map_err(|e| e.to_string())?;
        Command::new("chmod")
            .arg("+x")
            .arg(&self.agent)
            .status()
            .map_err(|e| e.to_string())?;
        Ok(())
    }

    /// `ip netns exec HOST unshare --uts sh -c 'hostname HOST; exec CMD'` as
    /// program and arguments for [`run`].
    pub fn exec_args(&self, host: usize, cmd: &str) -> Vec<String> {
        let name = &self.names[host];
        [
            "netns",
            "exec",
            name,
            "unshare",
            "--uts",
            "sh",
            "-c",
            &format!("hostname {name}; exec {cmd}"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = Command::new("ip").args(["netns", "del", name]).output();
            let _ = std::fs::remove_dir_all(format!("/etc/netns/{name}"));
        }
        let _ = std::fs::remove_file(&self.agent);
    }
}

/// Whether `name` runs (prints its version); if not, a message says the
/// test is skipped, or with COLL_REQUIRE_MPI=1 that is a failure.
pub fn has_command(name: &str) -> bool {
    let found = Command::new(name)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        let required = std::env::var("COLL_REQUIRE_MPI").is_ok_and(|v| v == "1");
        assert!(!required, "{name} is not installed, and COLL_REQUIRE_MPI=1");
        eprintln!("skipping: {name} is not installed");
    }
    found
}

/// Whether this machine has an RDMA device (soft-RoCE counts): if not, the
/// verbs test is skipped, or with COLL_REQUIRE_VERBS=1 that is a failure.
pub fn has_rdma_device() -> bool {
    let found = std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some());
    if !found {
        let required = std::env::var("COLL_REQUIRE_VERBS").is_ok_and(|v| v == "1");
        assert!(!required, "no RDMA device, and COLL_REQUIRE_VERBS=1");
        eprintln!("skipping: no RDMA device (see ci/rxe.sh to test on soft-RoCE)");
    }
    found
}

/// Open MPI refuses root and oversubscription unless told.
const OMPI_ENV: [(&str, &str); 3] = [
    ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
    ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
    ("OMPI_MCA_rmaps_base_oversubscribe", "1"),
];

/// Whether tests that need MPI must run rather than skip (CI sets
/// COLL_REQUIRE_MPI=1).
pub fn required() -> bool {
    std::env::var("COLL_REQUIRE_MPI").is_ok_and(|v| v == "1")
}

/// `name` (mpirun.openmpi, mpiexec.hydra, mpicc.openmpi) if installed;
/// `None` (a skip, said on stderr) if not, a failure when [`required`].
pub fn launcher(name: &'static str) -> Option<&'static str> {
    let found = std::process::Command::new(name)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if found {
        return Some(name);
    }
    assert!(
        !required(),
        "{name} is not installed (apt-get install openmpi-bin libopenmpi-dev mpich), and COLL_REQUIRE_MPI=1"
    );
    eprintln!(
        "skipping: {name} is not installed (apt-get install openmpi-bin libopenmpi-dev mpich)"
    );
    None
}

/// Runs `program args` under `launcher` with `n` ranks.
pub fn mpirun(launcher: &str, n: usize, program: &str, args: &[&str], env: &[(&str, &str)]) -> Run {
    let n = n.to_string();
    let mut all = vec!["-n", n.as_str(), program];
    all.extend_from_slice(args);
    let mut env = env.to_vec();
    env.extend_from_slice(&OMPI_ENV);
    // Unique ids and the rendezvous default to the first non-loopback
    // interface (right across hosts); tests on one host stay on loopback.
    if !env.iter().any(|(k, _)| *k == "COLL_SOCKET_IFNAME") {
        env.push(("COLL_SOCKET_IFNAME", "lo"));
    }
    run(Path::new(launcher), &all, &env, Duration::from_secs(600))
}
