//! Jobs launched by real mpirun: Open MPI's (`mpirun.openmpi`) and MPICH's
//! (`mpiexec.hydra`), with no MASTER_ADDR: ranks meet through the launcher
//! (PMI under MPICH) or on their host (Open MPI). The correctness matrix and
//! checked collbench sweeps at 2, 3 and 4 ranks, oversubscribed on 2 cores.
//!
//! Builds with the `mpi` feature (rendezvous by MPI broadcast) are tested
//! when COLL_MPI_COLLBENCH_OPENMPI / COLL_MPI_COLLBENCH_MPICH name them
//! (ci/test.sh builds both): under their own launcher, and refused with an
//! explanation under the other MPI's launcher.
//!
//! A launcher or build that is missing skips its tests with a message,
//! unless COLL_REQUIRE_MPI=1 (CI sets it), when that is a failure.

use std::path::Path;

use integration_tests::{assert_clean, launcher, mpirun, required, sibling, Run};

/// A clean checked sweep by `n` ranks that the launcher `source` started.
fn assert_sweep(r: &Run, what: &str, n: usize, source: &str) {
    assert_clean(r, what);
    assert!(
        r.stdout.contains(&format!("{n} ranks ({source})")),
        "{what}:\n{}",
        r.stdout
    );
}

fn matrix_under(launcher_name: &'static str) {
    let Some(l) = launcher(launcher_name) else {
        return;
    };
    let worker = env!("CARGO_BIN_EXE_coll-worker");
    for (n, transport) in [(2, "shm"), (3, "tcp"), (4, "shm")] {
        let r = mpirun(
            l,
            n,
            worker,
            &["matrix"],
            &[("COLL_TRANSPORT", transport), ("COLL_CHUNK", "64K")],
        );
        assert!(
            r.ok,
            "{l} -n {n} matrix over {transport} failed:\n{}\n{}",
            r.stdout, r.stderr
        );
        for rank in 0..n {
            assert!(
                r.stdout.contains(&format!("ok {rank}\n")),
                "{l}: rank {rank} did not finish:\n{}",
                r.stdout
            );
        }
    }
}

fn sweeps_under(launcher_name: &'static str, source: &str) {
    let Some(l) = launcher(launcher_name) else {
        return;
    };
    let collbench = sibling(env!("CARGO_BIN_EXE_coll-worker"), "collbench");
    let collbench = collbench.as_str();
    for n in [2, 3, 4] {
        for coll in ["allreduce", "alltoall"] {
            let r = mpirun(
                l,
                n,
                collbench,
                &[coll, "-b", "8", "-e", "4M", "-f", "16", "-c", "1"],
                &[],
            );
            assert_sweep(&r, &format!("{l} -n {n} collbench {coll}"), n, source);
        }
    }
}

#[test]
fn matrix_under_open_mpi() {
    matrix_under("mpirun.openmpi");
}

#[test]
fn matrix_under_mpich() {
    matrix_under("mpiexec.hydra");
}

#[test]
fn collbench_under_open_mpi() {
    sweeps_under("mpirun.openmpi", "Open MPI");
}

#[test]
fn collbench_under_mpich() {
    sweeps_under("mpiexec.hydra", "MPICH (PMI)");
}

/// The collbench built with the `mpi` feature against one MPI, if named.
fn feature_build(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(path) if Path::new(&path).exists() => Some(path),
        _ => {
            assert!(
                !required(),
                "{var} does not name a collbench built with --features mpi, and COLL_REQUIRE_MPI=1"
            );
            eprintln!("skipping: {var} does not name a collbench built with --features mpi");
            None
        }
    }
}

fn mpi_feature(own: &'static str, build_var: &str, other: &'static str, source: &str, lib: &str) {
    let (Some(own), Some(other), Some(bin)) =
        (launcher(own), launcher(other), feature_build(build_var))
    else {
        return;
    };
    for n in [2, 3] {
        let r = mpirun(
            own,
            n,
            &bin,
            &["allreduce", "-b", "8", "-e", "1M", "-f", "64", "-c", "1"],
            &[],
        );
        assert_sweep(&r, &format!("{own} -n {n} {bin}"), n, source);
    }
    // Under the other MPI's launcher every process would be rank 0 of 1.
    let r = mpirun(other, 2, &bin, &["allreduce", "--size", "8"], &[]);
    assert!(!r.ok, "{bin} ran under {other}:\n{}", r.stdout);
    assert!(
        r.stderr
            .contains(&format!("this binary is linked with {lib}")),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr
            .contains("built against another MPI than the launcher's"),
        "{}",
        r.stderr
    );
}

#[test]
fn mpi_feature_built_with_open_mpi() {
    mpi_feature(
        "mpirun.openmpi",
        "COLL_MPI_COLLBENCH_OPENMPI",
        "mpiexec.hydra",
        "Open MPI",
        "Open MPI",
    );
}

#[test]
fn mpi_feature_built_with_mpich() {
    mpi_feature(
        "mpiexec.hydra",
        "COLL_MPI_COLLBENCH_MPICH",
        "mpirun.openmpi",
        "MPICH (PMI)",
        "MPICH",
    );
}
