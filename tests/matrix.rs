//! The correctness matrix over real processes and sockets: every datatype,
//! reduction and size, in and out of place, at 1, 2, 3, 4 and 8 ranks, with
//! the default chunk (few chunks per message) and a 4 KiB chunk (hundreds,
//! so pipelining, staging reuse and uneven last chunks are exercised).

use std::time::Duration;

use integration_tests::run;

fn matrix(ranks: usize, chunk: &str) {
    let worker = std::path::Path::new(env!("CARGO_BIN_EXE_coll-worker"));
    let n = ranks.to_string();
    let env = [("COLL_CHUNK", chunk), ("COLL_TIMEOUT", "60")];
    let r = run(
        worker,
        &["--ranks", &n, "matrix"],
        &env,
        Duration::from_secs(600),
    );
    assert!(
        r.ok,
        "matrix at {ranks} ranks, chunk {chunk} failed:\n{}\n{}",
        r.stdout, r.stderr
    );
    for rank in 0..ranks {
        assert!(
            r.stdout.contains(&format!("ok {rank}\n")),
            "rank {rank} did not finish:\n{}",
            r.stdout
        );
    }
}

#[test]
fn one_rank() {
    matrix(1, "1M");
}

#[test]
fn two_ranks() {
    matrix(2, "1M");
}

#[test]
fn two_ranks_small_chunks() {
    matrix(2, "4K");
}

#[test]
fn three_ranks() {
    matrix(3, "4K");
}

#[test]
fn four_ranks() {
    matrix(4, "1M");
}

#[test]
fn eight_ranks() {
    matrix(8, "64K");
}
