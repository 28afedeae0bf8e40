//! Failures become errors that name the rank, the peer and the operation,
//! within the timeout, never hangs; and the launcher leaves no process behind.

use std::net::TcpListener;
use std::path::Path;
use std::time::Duration;

use integration_tests::{alive, closed_port, free_port, run, worker_pids, Run};

fn worker() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_coll-worker"))
}

/// Runs `coll-worker --ranks N MODE..` over `transport` with a short timeout.
fn job(ranks: usize, mode: &[&str], transport: &str, timeout_s: &str) -> Run {
    job_with(ranks, mode, transport, timeout_s, &[])
}

fn job_with(
    ranks: usize,
    mode: &[&str],
    transport: &str,
    timeout_s: &str,
    extra: &[(&str, &str)],
) -> Run {
    let n = ranks.to_string();
    let mut args = vec!["--ranks", &n];
    args.extend_from_slice(mode);
    let mut env = vec![("COLL_TIMEOUT", timeout_s), ("COLL_TRANSPORT", transport)];
    env.extend_from_slice(extra);
    run(worker(), &args, &env, Duration::from_secs(60))
}

const TRANSPORTS: [&str; 2] = ["tcp", "shm"];

/// Every listed rank printed an error naming itself and the operation.
fn assert_named(r: &Run, ranks: &[usize], op: &str) {
    for rank in ranks {
        let prefix = format!("rank {rank}: {op}");
        assert!(
            r.stderr
                .lines()
                .any(|l| l.starts_with(&prefix) && l.contains("peer rank")),
            "no error of rank {rank} naming {op} and a peer in:\n{}",
            r.stderr
        );
    }
}

fn assert_all_gone(r: &Run) {
    for pid in worker_pids(&r.stdout) {
        assert!(!alive(pid), "process {pid} outlived its job");
    }
}

#[test]
fn a_killed_rank_fails_the_others_quickly() {
    for t in TRANSPORTS {
        killed_rank(t);
    }
}

fn killed_rank(transport: &str) {
    let r = job(4, &["die"], transport, "20");
    assert!(!r.ok, "{transport}");
    assert!(
        r.stderr.contains("rank 1 was killed by signal 9"),
        "{}",
        r.stderr
    );
    // The neighbours see the connection close at once; the others hear
    // why from them. Nobody waits for the 20 s timeout.
    assert_named(&r, &[0, 2, 3], "allreduce #");
    assert!(
        r.stderr.contains("Connection closed by peer rank 1"),
        "{}",
        r.stderr
    );
    assert!(r.elapsed < Duration::from_secs(15), "took {:?}", r.elapsed);
    assert_all_gone(&r);
}

#[test]
fn a_silent_rank_times_out_with_the_peer_named() {
    for t in TRANSPORTS {
        silent_rank(t);
    }
}

fn silent_rank(transport: &str) {
    let r = job(3, &["stall"], transport, "2");
    assert!(!r.ok, "{transport}");
    // Each survivor names the peer it waited on: rank 1 itself, or a rank
    // stuck behind it, whichever timed out first.
    assert!(
        r.stderr.contains("Timed out waiting 2.0s for peer rank"),
        "{}",
        r.stderr
    );
    assert_named(&r, &[0, 2], "allreduce #");
    // The rank that timed out asked the others: the root cause is rank 1,
    // even when it waited on rank 2 (stuck behind 1).
    assert!(
        r.stderr
            .contains("root cause: rank 1 did not answer within 2 s while rank(s) "),
        "{transport}: {}",
        r.stderr
    );
    // The stopped rank is killed once the grace period after the first
    // failure is over.
    assert!(
        r.stderr.contains("rank 1 was still running"),
        "{}",
        r.stderr
    );
    assert_all_gone(&r);
}

/// A rank computing past the others' timeout is named as the root cause,
/// with where it is, by the ranks that time out waiting for it.
#[test]
fn a_rank_behind_is_named_as_the_root_cause() {
    for t in TRANSPORTS {
        let r = job(4, &["behind"], t, "2");
        assert!(!r.ok, "{t}");
        assert!(
            r.stderr.contains("root cause: rank 1 never entered allreduce #1 (1000 x f32, sum) (its last call, barrier #0, is done: it is in no call); rank(s) 0, 2, 3 wait for it"),
            "{t}: {}",
            r.stderr
        );
        assert_all_gone(&r);
    }
}

#[test]
fn disagreeing_ranks_are_told_what_differs() {
    disagreement("count", "allreduce #1 (1023 x f32, sum)", "shm");
    disagreement("dtype", "allreduce #1 (1024 x i32, sum)", "tcp");
    disagreement("op", "allreduce #1 (1024 x f32, max)", "shm");
}

/// One rank differs in `kind`; the error quotes its call or ours.
fn disagreement(kind: &str, theirs: &str, transport: &str) {
    let r = job(3, &["mismatch", kind], transport, "10");
    assert!(!r.ok, "{kind}");
    assert!(r.stderr.contains("disagree"), "{kind}: {}", r.stderr);
    assert!(
        r.stderr.contains(theirs) || r.stderr.contains("allreduce #1 (1024 x f32, sum)"),
        "{kind}: {}",
        r.stderr
    );
    assert!(
        r.elapsed < Duration::from_secs(8),
        "{kind} took {:?}",
        r.elapsed
    );
    assert_all_gone(&r);
}

/// A hostile rank inside a whole communicator: rank 1 writes random words
/// over every shared memory it can write (connection segments, its flag
/// segment) while calling. The honest ranks end with an error naming their
/// rank, none dies of a signal, and no guard word around their buffers
/// changes: whatever rank 1 wrote, nothing outside what they posted moved.
/// Random, so a weaker check than `transport`'s `shm::hostile` test: with
/// the shared-memory fragment check off, 1 run in 6 here killed an honest
/// rank (SIGABRT).
#[test]
fn a_rank_that_scribbles_over_shared_memory_harms_nothing_outside_the_buffers() {
    for seed in 0..5 {
        let r = job(4, &["scribble"], "shm", "20");
        assert!(!r.stderr.contains("guard words"), "{}", r.stderr);
        for rank in [0, 2, 3] {
            let signal = format!("rank {rank} was killed by signal");
            assert!(!r.stderr.contains(&signal), "run {seed}: {}", r.stderr);
            let prefix = format!("rank {rank}: ");
            assert!(
                r.stderr.lines().any(|l| l.starts_with(&prefix)),
                "run {seed}: no error of rank {rank} in:\n{}",
                r.stderr
            );
        }
        assert!(r.elapsed < Duration::from_secs(45), "took {:?}", r.elapsed);
        assert_all_gone(&r);
    }
}

/// The flag path for small calls (COLL_TINY) fails as the general path
/// does: a killed peer and a disagreeing one are named, promptly.
#[test]
fn small_calls_through_shared_flags_fail_with_the_peer_named() {
    let tiny = [("COLL_TINY", "4K")];
    let r = job_with(4, &["die-small"], "shm", "20", &tiny);
    assert!(!r.ok);
    assert!(
        r.stderr.contains("rank 1 was killed by signal 9"),
        "{}",
        r.stderr
    );
    assert_named(&r, &[0, 2, 3], "allreduce #");
    assert!(r.elapsed < Duration::from_secs(15), "took {:?}", r.elapsed);
    assert_all_gone(&r);
    for kind in ["count", "root", "roots"] {
        let r = job_with(3, &["mismatch", kind], "shm", "10", &tiny);
        assert!(!r.ok, "{kind}");
        assert!(r.stderr.contains("disagree"), "{kind}: {}", r.stderr);
        assert!(r.elapsed < Duration::from_secs(8), "took {:?}", r.elapsed);
        assert_all_gone(&r);
    }
    // Rank 1's 4092 bytes take the flag path, the others' 4096 do not: the
    // rank waiting on a flag reads that its peer went the general way.
    let r = job_with(
        3,
        &["mismatch", "count"],
        "shm",
        "10",
        &[("COLL_TINY", "4092")],
    );
    assert!(!r.ok);
    assert!(
        r.stderr.contains("rank 1: allreduce #1 (1023 x f32, sum)")
            && r.stderr.contains("disagree")
            && r.stderr.contains("allreduce #1 (1024 x f32, sum)"),
        "{}",
        r.stderr
    );
    assert!(r.elapsed < Duration::from_secs(8), "took {:?}", r.elapsed);
    assert_all_gone(&r);
}

#[test]
fn a_rank_that_never_arrives_is_named() {
    let r = job(3, &["late"], "auto", "2");
    assert!(!r.ok);
    assert!(
        r.stderr
            .contains("rank(s) [1] of 3 did not reach the rendezvous"),
        "{}",
        r.stderr
    );
    assert_all_gone(&r);
}

/// Killing a whole job (launcher and ranks, SIGKILL, mid-collective) leaves
/// no process and nothing in /dev/shm behind.
#[test]
fn a_killed_job_leaves_nothing_behind() {
    use std::process::{Command, Stdio};
    let shm_before = dev_shm();
    let mut launcher = Command::new(worker())
        .args(["--ranks", "4", "pingpong", "100000000"])
        .env("COLL_TRANSPORT", "shm")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until every rank is inside the loop of collectives.
    let mut out = launcher.stdout.take().unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 256];
    while seen.matches("pid ").count() < 4 {
        let n = std::io::Read::read(&mut out, &mut buf).unwrap();
        assert!(n > 0, "the job ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    std::thread::sleep(Duration::from_millis(300));
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    // The ranks die with their launcher (PR_SET_PDEATHSIG).
    let pids = worker_pids(&seen);
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|p| alive(*p)) && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    for pid in pids {
        assert!(
            !alive(pid),
            "rank process {pid} outlived its killed launcher"
        );
    }
    assert_eq!(dev_shm(), shm_before, "the job left files in /dev/shm");
}

fn dev_shm() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// One rank of a two-rank job started by hand, torchrun style.
fn env_rank(rank: &str, addr: &str, port: &str, timeout: &str) -> Run {
    let env = [
        ("RANK", rank),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", addr),
        ("MASTER_PORT", port),
        ("COLL_TIMEOUT", timeout),
    ];
    run(worker(), &["pingpong", "5"], &env, Duration::from_secs(30))
}

#[test]
fn an_unreachable_master_is_reported() {
    let (_held, port) = closed_port();
    let port = port.to_string();
    let r = env_rank("1", "127.0.0.1", &port, "2");
    assert!(!r.ok);
    assert!(
        r.stderr
            .contains("rank 1: bootstrap failed: could not reach the rendezvous at 127.0.0.1:"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("MASTER_ADDR"), "{}", r.stderr);

    let r = env_rank("1", "no-such-host.invalid", &port, "2");
    assert!(!r.ok);
    assert!(
        r.stderr
            .contains("cannot resolve MASTER_ADDR 'no-such-host.invalid'"),
        "{}",
        r.stderr
    );

    let r = env_rank("0", "192.0.2.1", &port, "2");
    assert!(!r.ok);
    assert!(
        r.stderr.contains("is not an address of this host"),
        "{}",
        r.stderr
    );
}

#[test]
fn a_port_in_use_is_reported() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let r = env_rank("0", "127.0.0.1", &port, "2");
    assert!(!r.ok);
    assert!(
        r.stderr
            .contains(&format!("port {port} on 127.0.0.1 is already in use")),
        "{}",
        r.stderr
    );
}

#[test]
fn strangers_at_the_rendezvous_are_refused_and_the_job_goes_on() {
    use std::io::Write;
    let port = free_port();
    let p = port.to_string();
    let rank0 = {
        let p = p.clone();
        std::thread::spawn(move || env_rank("0", "127.0.0.1", &p, "20"))
    };
    // Knock on the rendezvous before rank 1 arrives: garbage, then a
    // well-formed message of another job.
    // Each knock waits for the rendezvous to answer or hang up, so that
    // rank 1 arrives after both were dealt with.
    let knock = |bytes: &[u8]| {
        for _ in 0..100 {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                let _ = s.write_all(bytes);
                let _ = s.set_read_timeout(Some(Duration::from_secs(15)));
                let _ = std::io::Read::read_to_end(&mut s, &mut Vec::new());
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("rank 0's rendezvous never came up");
    };
    knock(b"GET / HTTP/1.0\r\n\r\n");
    // A join of the right shape whose proof is not under this job's token.
    let other_job = br#"{"proof":"00112233445566778899aabbccddeeff","body":"{\"size\":2,\"info\":{\"rank\":1,\"hostname\":\"x\",\"host_id\":\"x\",\"pid\":1,\"cores\":2,\"addresses\":{},\"settings\":\"transport=auto chunk=1048576\"},\"relay\":\"127.0.0.1:1\",\"nonce\":\"00\"}"}"#;
    let mut msg = (other_job.len() as u32).to_le_bytes().to_vec();
    msg.extend_from_slice(other_job);
    knock(&msg);
    let r1 = env_rank("1", "127.0.0.1", &p, "20");
    let r0 = rank0.join().unwrap();
    assert!(
        r0.ok && r1.ok,
        "rank 0:\n{}\nrank 1:\n{}",
        r0.stderr,
        r1.stderr
    );
    assert!(
        r0.stderr
            .contains("a joiner as rank 1 did not prove this job's token"),
        "{}",
        r0.stderr
    );
    assert!(
        r0.stderr.contains("rendezvous ignored a connection"),
        "{}",
        r0.stderr
    );
}

// The same failures over RDMA verbs, inside a soft-RoCE VM (ci/rxe.sh).
#[cfg(feature = "verbs")]
#[test]
fn verbs_failures_are_named_too() {
    if integration_tests::has_rdma_device() {
        killed_rank("verbs");
        silent_rank("verbs");
        disagreement("count", "allreduce #1 (1023 x f32, sum)", "verbs");
    }
}

/// A rank stopped for 10 s (shorter than the timeout) in the middle of
/// 4-rank 256 MiB AllToAlls: the others wait with their memory at their
/// buffers plus bounded staging, and the job then completes correctly.
#[test]
fn a_stopped_rank_resumes_and_memory_stays_bounded() {
    for t in TRANSPORTS {
        let r = job(4, &["pause"], t, "30");
        assert!(r.ok, "pause over {t}:\n{}\n{}", r.stdout, r.stderr);
        let buffers = 2 * (256u64 << 20);
        for line in r.stdout.lines().filter(|l| l.starts_with("peak ")) {
            let bytes: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
            assert!(
                bytes < buffers + (96 << 20),
                "{t}: {line}: more than the buffers + 96 MiB"
            );
        }
        assert_eq!(r.stdout.matches("peak ").count(), 4, "{}", r.stdout);
        assert!(
            r.elapsed > Duration::from_secs(10),
            "the stop did not happen: {:?}",
            r.elapsed
        );
    }
}

/// Runs `mode` with the flight records dumped into a fresh directory, and
/// returns what `collbench trace` says of them.
fn traced(mode: &str, transport: &str) -> String {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("trace-{mode}-{transport}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let n = "4";
    let env = [
        ("COLL_TIMEOUT", "3"),
        ("COLL_TRANSPORT", transport),
        ("COLL_TRACE_DUMP_DIR", dir.to_str().unwrap()),
    ];
    let r = run(
        worker(),
        &["--ranks", n, mode],
        &env,
        Duration::from_secs(60),
    );
    assert!(!r.ok, "{mode} succeeded");
    assert_all_gone(&r);
    let collbench = integration_tests::sibling(env!("CARGO_BIN_EXE_coll-worker"), "collbench");
    let t = run(
        Path::new(&collbench),
        &["trace", dir.to_str().unwrap()],
        &[],
        Duration::from_secs(10),
    );
    assert!(t.ok, "collbench trace failed: {}", t.stderr);
    t.stdout
}

/// The flight records name the rank at fault for each kind of failure.
#[test]
fn the_flight_records_name_the_rank_at_fault() {
    for t in TRANSPORTS {
        let stalled = traced("stall", t);
        assert!(
            stalled.contains("verdict: rank 1 left no record while rank(s) "),
            "{t}: {stalled}"
        );
        let skipped = traced("skip", t);
        assert!(
            // (A rank still finishing the barrier before counts in neither list.)
            skipped.contains(
                "verdict: rank(s) 1 called broadcast #1 (10 x f32, root 0) where rank(s) 0, "
            ) && skipped.contains("called allreduce #1"),
            "{t}: {skipped}"
        );
        let different = traced("different", t);
        assert!(
            different.contains("verdict: rank(s) 1 called allgather #1")
                && different.contains("called allreduce #1"),
            "{t}: {different}"
        );
    }
}

/// SIGUSR1 makes a rank blocked in a call dump its flight record, which
/// shows the call and what it waits on; the job goes on.
#[test]
fn sigusr1_dumps_the_flight_record_of_a_blocked_rank() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("trace-usr1");
    let _ = std::fs::remove_dir_all(&dir);
    let env = [
        ("COLL_TRACE_DUMP_DIR", dir.to_str().unwrap()),
        ("COLL_TIMEOUT", "20"),
    ];
    let r = run(
        worker(),
        &["--ranks", "2", "usr1"],
        &env,
        Duration::from_secs(60),
    );
    assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
    let file = std::fs::read_dir(&dir).unwrap().flatten().find(|f| {
        f.file_name()
            .to_string_lossy()
            .starts_with("coll-trace-rank0-")
    });
    let text = std::fs::read_to_string(file.expect("rank 0 dumped").path()).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(doc["reason"], "SIGUSR1");
    let calls = doc["calls"].as_array().unwrap();
    let current = calls
        .iter()
        .rev()
        .find(|c| c["state"] == "running")
        .expect("a running call");
    assert_eq!(current["collective"], "send/recv");
    assert_eq!(current["waiting_on"]["peer"], 1, "{current}");
    assert!(
        doc["stats"]["peers"][1]["messages_sent"].as_u64().unwrap() > 0,
        "{}",
        doc["stats"]
    );
}

/// 20 jobs (4 and 8 ranks, tcp and shm) in which one or two ranks SIGKILL
/// themselves at a random moment: every survivor agrees on the same failed
/// set (the ranks that died), shrinks, and finishes every checked step;
/// nobody hangs. Prints the detection-to-resumed times.
#[test]
fn survivors_agree_shrink_and_finish_after_random_kills() {
    for seed in 0..20u64 {
        let n = if seed % 2 == 0 { 4 } else { 8 };
        let transport = if seed % 4 < 2 { "tcp" } else { "shm" };
        elastic_job(seed, n, transport);
    }
}

// The same over RDMA verbs, inside a soft-RoCE VM (ci/rxe.sh). Not in CI:
// there a rank dying while the survivors set up their new connections can
// cost a survivor the full timeout (seen 1 run in 4, emulated), sometimes
// twice, past the launcher's grace. By hand:
//   ci/rxe.sh -- target/verbs/release/deps/faults-* --ignored verbs_survivors
#[cfg(feature = "verbs")]
#[test]
#[ignore = "a death during the shrink's connection setup over verbs can take the full timeout"]
fn verbs_survivors_agree_shrink_and_finish() {
    if integration_tests::has_rdma_device() {
        for seed in [0, 10] {
            elastic_job(seed, 4, "verbs");
        }
    }
}

/// One job of `elastic`: its victims die, the survivors finish alike.
fn elastic_job(seed: u64, n: usize, transport: &str) {
    {
        // (Soft-RoCE in a VM is slow: fewer steps still outlast the kills.)
        let steps = match (transport, n) {
            ("verbs", _) => "1000",
            (_, 4) => "3000",
            _ => "1500",
        };
        let seed_text = seed.to_string();
        let r = job(n, &["elastic", &seed_text, steps], transport, "20");
        let what = format!("seed {seed}, {n} ranks over {transport}");
        let killed: Vec<usize> = (0..n)
            .filter(|k| {
                r.stderr
                    .contains(&format!("rank {k} was killed by signal 9"))
            })
            .collect();
        assert!(!killed.is_empty(), "{what}: nobody died\n{}", r.stderr);
        assert!(
            !r.stderr.contains("still running"),
            "{what}: a hang\n{}",
            r.stderr
        );
        let done: Vec<&str> = r
            .stdout
            .lines()
            .filter(|l| l.starts_with("done "))
            .collect();
        assert_eq!(
            done.len(),
            n - killed.len(),
            "{what}\n{}\n{}",
            r.stdout,
            r.stderr
        );
        let expected = format!("size {} failed {killed:?}", n - killed.len());
        for line in &done {
            assert!(
                line.ends_with(&expected),
                "{what}: {line}, expected {expected}"
            );
        }
        // From the last death before each shrink to that survivor holding
        // the new communicator (agreed, connected, past its barrier).
        let deaths: Vec<u128> = (r.stdout.lines())
            .filter_map(|l| l.strip_prefix("dying ")?.parse().ok())
            .collect();
        let ms: Vec<u128> = (r.stdout.lines())
            .filter_map(|l| l.split(" at ").nth(1)?.split(' ').next()?.parse().ok())
            .map(|at: u128| {
                let death = deaths
                    .iter()
                    .filter(|d| **d <= at)
                    .max()
                    .copied()
                    .unwrap_or(at);
                (at - death) / 1000
            })
            .collect();
        println!("{what}: killed {killed:?}, kill to shrunk (ms, per survivor and shrink): {ms:?}");
        assert_all_gone(&r);
    }
}

/// A low open-files limit: a soft one is raised to the hard one so the TCP
/// connections fit; a hard one too low is an error that says so.
#[test]
fn the_open_files_limit_is_raised_or_named() {
    // Connecting to every peer at once (a pingpong alone connects few).
    let under = |limits: &str| {
        let script = format!(
            "ulimit {limits} && exec {} --ranks 8 pingpong 3",
            worker().display()
        );
        let env = [
            ("COLL_TIMEOUT", "20"),
            ("COLL_TRANSPORT", "tcp"),
            ("COLL_CONNECT", "eager"),
        ];
        run(
            Path::new("/bin/sh"),
            &["-c", &script],
            &env,
            Duration::from_secs(60),
        )
    };
    let r = under("-Sn 20");
    assert!(r.ok, "{}", r.stderr);
    let r = under("-n 50");
    assert!(!r.ok);
    assert!(
        r.stderr
            .contains("open files for its connections, and the hard limit is 50"),
        "{}",
        r.stderr
    );
    assert!(r.elapsed < Duration::from_secs(20), "took {:?}", r.elapsed);
}
