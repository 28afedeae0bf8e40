//! Several hosts for real: network namespaces joined by veth pairs, each a
//! host with its own ranks. Ranks of one host talk over shared memory,
//! ranks of different hosts over TCP across the veth links; the jobs are
//! launched torchrun-style and by Open MPI's and MPICH's mpirun through an
//! ssh stand-in that enters a namespace. Skipped with a message where
//! namespaces cannot be made (not root), unless COLL_REQUIRE_NETNS=1.

use std::path::Path;
use std::time::Duration;

use integration_tests::{assert_clean, run, Hosts};

fn collbench() -> String {
    integration_tests::sibling(env!("CARGO_BIN_EXE_coll-worker"), "collbench")
}

/// 2 hosts x 2 ranks, torchrun-style variables, MASTER_ADDR on host 0.
#[test]
fn ranks_on_two_hosts_use_tcp_between_and_shm_within() {
    let Some(hosts) = Hosts::new(2) else { return };
    let cmd = format!(
        "env COLL_DEBUG=info {} allreduce -b 8 -e 8M -f 32 -c 1",
        collbench()
    );
    let runs = hosts.torchrun(2, 29611, &cmd);
    for r in &runs[1..] {
        assert!(r.ok, "{}", r.stderr);
    }
    let r0 = &runs[0];
    assert_clean(r0, "4 ranks on 2 hosts");
    assert!(r0.stdout.contains("transport tcp+shm"), "{}", r0.stdout);
    assert!(
        r0.stdout
            .contains(&format!("host {}: ranks [0, 1]", hosts.names[0])),
        "{}",
        r0.stdout
    );
    assert!(
        r0.stdout
            .contains(&format!("host {}: ranks [2, 3]", hosts.names[1])),
        "{}",
        r0.stdout
    );
    assert!(
        r0.stderr.contains("1 via shm") && r0.stderr.contains("2 via tcp"),
        "{}",
        r0.stderr
    );
}

/// The hierarchical AllReduce where it belongs: the correctness matrix on
/// 2 hosts x 2 ranks, and a checked sweep on 2 hosts x 4 ranks.
#[test]
fn hierarchical_allreduce_across_two_hosts() {
    let Some(hosts) = Hosts::new(2) else { return };
    let worker = env!("CARGO_BIN_EXE_coll-worker");
    let cmd = format!(
        "env COLL_ALGO=allreduce=hierarchical COLL_CHUNK=64K COLL_TIMEOUT=60 {worker} matrix"
    );
    for (rank, r) in hosts.torchrun(2, 29612, &cmd).iter().enumerate() {
        assert!(
            r.ok && r.stdout.contains(&format!("ok {rank}")),
            "rank {rank}:\n{}\n{}",
            r.stdout,
            r.stderr
        );
    }
    let cmd = format!(
        "env COLL_DEBUG=info {} allreduce -b 8 -e 64M -f 8 -c 1 --algo hierarchical",
        collbench()
    );
    let runs = hosts.torchrun(4, 29613, &cmd);
    for r in &runs[1..] {
        assert!(r.ok, "{}", r.stderr);
    }
    assert_clean(&runs[0], "hierarchical, 2 hosts x 4 ranks");
    assert!(
        runs[0].stdout.contains("algorithm hierarchical"),
        "{}",
        runs[0].stdout
    );
}

fn mpirun_across(launcher_args: &[String], bench: &str, hosts: &Hosts, what: &str) {
    let cmd = format!(
        "{} {bench} allreduce -b 8 -e 8M -f 32 -c 1",
        launcher_args.join(" ")
    );
    let args = hosts.exec_args(0, &cmd);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let env = [
        ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
        ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
        ("OMPI_MCA_rmaps_base_oversubscribe", "1"),
    ];
    let r = run(Path::new("ip"), &args, &env, Duration::from_secs(180));
    assert_clean(&r, what);
    assert!(
        r.stdout.contains("transport tcp+shm"),
        "{what}:\n{}",
        r.stdout
    );
    for name in &hosts.names {
        assert!(
            r.stdout.contains(&format!("host {name}:")),
            "{what}:\n{}",
            r.stdout
        );
    }
}

fn host_list(hosts: &Hosts) -> String {
    hosts
        .names
        .iter()
        .map(|n| format!("{n}:2"))
        .collect::<Vec<_>>()
        .join(",")
}

/// MPICH's mpiexec across 2 hosts: ranks meet through PMI, no MASTER_ADDR.
#[test]
fn mpich_launches_across_hosts() {
    if !integration_tests::has_command("mpiexec.hydra") {
        return;
    }
    let Some(hosts) = Hosts::new(2) else { return };
    let launcher = vec![
        "mpiexec.hydra".to_string(),
        "-launcher ssh -launcher-exec".into(),
        hosts.agent.to_string_lossy().into_owned(),
        format!("-hosts {} -n 4", host_list(&hosts)),
    ];
    mpirun_across(
        &launcher,
        &collbench(),
        &hosts,
        "mpiexec.hydra across 2 hosts",
    );
}

/// Open MPI's mpirun across 2 hosts, with the `mpi` feature build (ranks
/// meet by MPI broadcast; Open MPI has no PMI-1 we speak).
#[test]
fn open_mpi_launches_across_hosts() {
    if !integration_tests::has_command("mpirun.openmpi") {
        return;
    }
    let Ok(bench) = std::env::var("COLL_MPI_COLLBENCH_OPENMPI") else {
        eprintln!("skipping: COLL_MPI_COLLBENCH_OPENMPI does not name a collbench built with --features mpi");
        return;
    };
    let Some(hosts) = Hosts::new(2) else { return };
    let launcher = vec![
        "mpirun.openmpi --mca plm_rsh_agent".to_string(),
        hosts.agent.to_string_lossy().into_owned(),
        format!(
            "--mca oob_tcp_if_include 10.77.0.0/24 --host {} -n 4",
            host_list(&hosts)
        ),
    ];
    mpirun_across(&launcher, &bench, &hosts, "mpirun.openmpi across 2 hosts");
}
