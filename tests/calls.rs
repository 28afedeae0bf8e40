//! The calls frameworks make beyond the classic collectives, over real
//! processes and both transports: point-to-point that overlaps, groups,
//! split children used at once from several threads, abort from another
//! thread, and named errors for AllToAllv and send/recv counts that disagree.
//! (AllToAllv and send/recv correctness over every dtype and size is in the
//! matrix, `matrix.rs`.)

use std::path::Path;
use std::time::Duration;

use integration_tests::{run, Run};

fn job(ranks: usize, mode: &str, transport: &str, timeout_s: &str) -> Run {
    job_with(ranks, mode, transport, timeout_s, &[])
}

fn job_with(
    ranks: usize,
    mode: &str,
    transport: &str,
    timeout_s: &str,
    extra: &[(&str, &str)],
) -> Run {
    let worker = Path::new(env!("CARGO_BIN_EXE_coll-worker"));
    let n = ranks.to_string();
    let mut env = vec![("COLL_TIMEOUT", timeout_s), ("COLL_TRANSPORT", transport)];
    env.extend_from_slice(extra);
    run(
        worker,
        &["--ranks", &n, mode],
        &env,
        Duration::from_secs(120),
    )
}

const TRANSPORTS: [&str; 2] = ["tcp", "shm"];

fn assert_ok(r: &Run, what: &str) {
    assert!(r.ok, "{what} failed:\n{}\n{}", r.stdout, r.stderr);
}

#[test]
fn nonblocking_sends_and_receives_overlap_each_other_and_collectives() {
    for t in TRANSPORTS {
        assert_ok(&job(3, "overlap", t, "30"), &format!("overlap over {t}"));
    }
}

/// Broadcast and Reduce loops with rotating roots, every result checked: on
/// shared memory ranks that read little run ahead of the rest.
#[test]
fn rooted_calls_in_long_runs_stay_right_while_ranks_run_ahead() {
    for (n, t) in [(3, "shm"), (5, "shm"), (3, "tcp")] {
        assert_ok(
            &job(n, "rooted", t, "30"),
            &format!("rooted calls, {n} ranks over {t}"),
        );
    }
}

/// A root that broadcasts thousands of calls in a row runs as far ahead as
/// the flag path's slots allow; every call is checked on every rank. With
/// a COLL_TINY over 4 KiB there are fewer data slots than slot headers (64
/// at 64 KiB), and a part that does not go inline waits for its own.
#[test]
fn a_broadcast_stream_stays_right_however_far_the_root_runs_ahead() {
    for tiny in ["4K", "64K"] {
        assert_ok(
            &job_with(3, "stream", "shm", "30", &[("COLL_TINY", tiny)]),
            &format!("a stream of broadcasts, 3 ranks, COLL_TINY={tiny}"),
        );
    }
}

#[test]
fn split_children_and_parent_run_at_once_from_threads() {
    for t in TRANSPORTS {
        assert_ok(&job(4, "split", t, "30"), &format!("split of 4 over {t}"));
    }
    assert_ok(&job(5, "split", "shm", "30"), "split of 5");
}

#[test]
fn abort_from_another_thread_ends_the_blocked_call_and_tells_the_peers() {
    for t in TRANSPORTS {
        let r = job(3, "abort", t, "60");
        assert_ok(&r, &format!("abort over {t}"));
        // Rank 0's own call ends at the abort (300 ms), its peers hear of it
        // at once: nobody waits for the 60 s timeout.
        let line = |rank: usize| {
            (r.stdout.lines())
                .find(|l| l.starts_with(&format!("rank {rank} ended")))
                .unwrap_or_else(|| panic!("no outcome of rank {rank}:\n{}", r.stdout))
                .to_string()
        };
        let zero = line(0);
        assert!(
            zero.contains("Aborted") && zero.contains("stopped by the test's watchdog"),
            "{zero}"
        );
        for rank in [1, 2] {
            let l = line(rank);
            assert!(
                l.contains("Remote")
                    && l.contains(
                        "aborted (Connection closed by peer): stopped by the test's watchdog"
                    ),
                "{l}"
            );
        }
        // A call with nothing to move returns without a transfer: it still
        // refuses on an aborted communicator, and checks its root.
        for rank in 0..3 {
            assert!(
                line(rank).ends_with("an empty call after: Err(Aborted)"),
                "{}",
                line(rank)
            );
            let root = format!("rank {rank} empty call with no root: InvalidArgument");
            assert!(r.stdout.contains(&root), "{}", r.stdout);
        }
        assert!(r.elapsed < Duration::from_secs(20), "took {:?}", r.elapsed);
    }
}

#[test]
fn counts_that_disagree_are_named_errors() {
    for t in TRANSPORTS {
        for (mode, call) in [
            ("mismatch-v", "alltoallv #1"),
            ("mismatch-p2p", "send/recv #0"),
        ] {
            let r = job(3, mode, t, "20");
            assert!(!r.ok, "{mode} over {t} succeeded");
            assert!(
                (r.stderr.lines()).any(|l| l.starts_with(&format!("rank 1: {call}"))
                    && l.contains("peer rank 0")
                    && l.contains("disagree")),
                "{mode} over {t}: rank 1 did not name the disagreement:\n{}",
                r.stderr
            );
            assert!(
                r.elapsed < Duration::from_secs(15),
                "{mode} took {:?}",
                r.elapsed
            );
        }
    }
}

#[test]
fn groups_run_every_transfer_at_once_fuse_small_allreduces_and_report_at_the_end() {
    for t in TRANSPORTS {
        for n in [2, 3] {
            assert_ok(
                &job(n, "group", t, "30"),
                &format!("group, {n} ranks over {t}"),
            );
        }
        // Rank 2 receives from the dead rank 1 and must say so (rank 0's
        // send may complete into TCP's buffers before rank 1 is gone).
        let r = job(3, "group-die", t, "20");
        assert!(!r.ok, "group-die over {t} succeeded");
        assert!(
            r.stderr.contains("rank 2: send/recv") && r.stderr.contains("peer rank 1"),
            "group-die over {t}: the error does not name the call and rank 1:\n{}",
            r.stderr
        );
    }
}
