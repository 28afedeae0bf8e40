//! A core shared with other work, for real: a busy loop pinned to the core
//! of one of two ranks while they run. That rank finds its core shared and
//! offers its peer every copy it can (see `offer_help` in
//! transport/src/shm/connection.rs), so its peer writes into its buffers
//! even where nothing is reduced: every result is checked. Its own binary,
//! so that the busy loop slows no other test.

use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use integration_tests::{assert_clean, run};

/// A shell busy loop pinned to `core`, killed when dropped.
struct BusyLoop(Child);

impl BusyLoop {
    fn on(core: usize) -> Self {
        let child = Command::new("taskset")
            .args(["-c", &core.to_string(), "sh", "-c", "while :; do :; done"])
            .spawn()
            .expect("taskset (util-linux) starts a busy loop");
        BusyLoop(child)
    }
}

impl Drop for BusyLoop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn copies_a_peer_takes_over_from_a_shared_core_are_right() {
    // collbench binds rank i to the i-th CPU it may use: the busy loop goes
    // beside rank 1.
    let allowed = rustix::thread::sched_getaffinity(None).expect("sched_getaffinity");
    let mut cpus = (0..rustix::thread::CpuSet::MAX_CPU).filter(|c| allowed.is_set(*c));
    let Some(rank1_cpu) = cpus.nth(1) else {
        eprintln!("skipping: one core, no core of its own for the other rank");
        return;
    };
    let collbench = integration_tests::sibling(env!("CARGO_BIN_EXE_coll-worker"), "collbench");
    let _busy = BusyLoop::on(rank1_cpu);
    // Rank 1 receives: the root is 0 for Broadcast, 1 for Reduce. 4000008
    // B (1000002 floats, 500001 a rank's block) ends in a short chunk.
    for (coll, root) in [
        ("broadcast", "0"),
        ("allgather", "0"),
        ("alltoall", "0"),
        ("reduce", "1"),
    ] {
        let args = [
            coll,
            "-n",
            "2",
            "--size",
            "1M,16M,4000008",
            "--iters",
            "20",
            "--root",
            root,
            "-c",
            "1",
        ];
        let env = [("COLL_DEBUG", "info"), ("COLL_TIMEOUT", "60")];
        let r = run(Path::new(&collbench), &args, &env, Duration::from_secs(120));
        assert_clean(&r, &format!("{coll} beside a busy loop"));
        assert!(
            r.stderr.contains("this core is shared with other work"),
            "{coll}: no rank found its core shared:\n{}",
            r.stderr
        );
    }
}
