//! The correctness matrix over real processes, real sockets and real shared
//! memory: every collective, algorithm, datatype, reduction and size, in and
//! out of place, at 1, 2, 3, 4, 5 and 8 ranks, over TCP and shared memory (with and without
//! single-copy reads), with large chunks (few per message) and 4 KiB ones
//! (hundreds, so pipelining, staging reuse and uneven last chunks run).

use std::time::Duration;

use integration_tests::run;

fn matrix(ranks: usize, chunk: &str, transport: &str) {
    matrix_with(ranks, chunk, transport, &[]);
}

fn matrix_with(ranks: usize, chunk: &str, transport: &str, extra: &[(&str, &str)]) {
    let worker = std::path::Path::new(env!("CARGO_BIN_EXE_coll-worker"));
    let n = ranks.to_string();
    let mut env = vec![
        ("COLL_CHUNK", chunk),
        ("COLL_TIMEOUT", "60"),
        ("COLL_TRANSPORT", transport),
    ];
    env.extend_from_slice(extra);
    let r = run(
        worker,
        &["--ranks", &n, "matrix"],
        &env,
        Duration::from_secs(600),
    );
    assert!(
        r.ok,
        "matrix at {ranks} ranks over {transport}, chunk {chunk} failed:\n{}\n{}",
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

// The selector picks by size; forcing each algorithm runs it at every size.
const RING: (&str, &str) = (
    "COLL_ALGO",
    "allreduce=ring,reducescatter=ring,allgather=ring,broadcast=chain,reduce=chain",
);
const DIRECT: (&str, &str) = (
    "COLL_ALGO",
    "allreduce=direct,allgather=direct,broadcast=direct,reduce=direct",
);
const TREE: (&str, &str) = (
    "COLL_ALGO",
    "allreduce=tree,reducescatter=tree,broadcast=binomial,reduce=binomial",
);

const LOG_ROUNDS: (&str, &str) = (
    "COLL_ALGO",
    "allreduce=rabenseifner,alltoall=bruck,allgather=bruck,reducescatter=halving,reduce=ring",
);

#[test]
fn one_rank() {
    matrix(1, "1M", "auto");
}

#[test]
fn two_ranks_shm() {
    matrix(2, "1M", "shm");
}

#[test]
fn two_ranks_shm_ring_two_copies_small_chunks() {
    matrix_with(
        2,
        "4K",
        "shm",
        &[("COLL_SHM_SINGLE_COPY", "0"), RING, NO_FLAGS],
    );
}

#[test]
fn two_ranks_tcp_small_chunks() {
    matrix(2, "4K", "tcp");
}

#[test]
fn three_ranks_shm_ring_small_chunks() {
    matrix_with(3, "4K", "shm", &[RING, NO_FLAGS]);
}

#[test]
fn three_ranks_tcp_direct() {
    matrix_with(3, "1M", "tcp", &[DIRECT]);
}

#[test]
fn four_ranks_shm_direct() {
    matrix_with(4, "64K", "shm", &[DIRECT, NO_FLAGS]);
}

#[test]
fn four_ranks_tcp_ring() {
    matrix_with(4, "64K", "tcp", &[RING]);
}

#[test]
fn three_ranks_tcp_tree() {
    matrix_with(3, "64K", "tcp", &[TREE]);
}

#[test]
fn five_ranks_shm_tree_small_chunks() {
    matrix_with(5, "4K", "shm", &[TREE, NO_FLAGS]);
}

// Over shared memory, small collectives (all but AllToAllv) and barriers take the flag path
// (COLL_TINY, 64 KiB by default): a forced algorithm is tested at every size
// with it off, and one case moves the threshold so that flag calls and
// general ones alternate within a run.
const NO_FLAGS: (&str, &str) = ("COLL_TINY", "0");

#[test]
fn three_ranks_shm() {
    matrix(3, "1M", "shm");
}

#[test]
fn four_ranks_shm_flags_up_to_64_bytes() {
    matrix_with(4, "4K", "shm", &[("COLL_TINY", "64")]);
}

#[test]
fn three_ranks_shm_rabenseifner_bruck_small_chunks() {
    matrix_with(3, "4K", "shm", &[LOG_ROUNDS, NO_FLAGS]);
}

#[test]
fn six_ranks_tcp_rabenseifner_bruck() {
    matrix_with(6, "64K", "tcp", &[LOG_ROUNDS]);
}

#[test]
fn eight_ranks_shm_rabenseifner_bruck_small_chunks() {
    matrix_with(8, "4K", "shm", &[LOG_ROUNDS, NO_FLAGS]);
}

#[test]
fn eight_ranks_shm() {
    matrix(8, "64K", "shm");
}

#[test]
fn eight_ranks_tcp_ring() {
    matrix_with(8, "1M", "tcp", &[RING]);
}

// Over RDMA verbs: run inside a soft-RoCE VM by ci/rxe.sh (skipped where
// there is no device). One rank pair per queue pair, so shared memory is
// out of the picture even on one host.
#[cfg(feature = "verbs")]
mod verbs {
    use super::*;
    use integration_tests::has_rdma_device;

    #[test]
    fn two_ranks_verbs() {
        if has_rdma_device() {
            matrix(2, "1M", "verbs");
        }
    }

    #[test]
    fn three_ranks_verbs_ring_small_chunks() {
        if has_rdma_device() {
            matrix_with(3, "4K", "verbs", &[RING]);
        }
    }

    #[test]
    fn two_ranks_verbs_three_queue_pairs_per_peer() {
        if has_rdma_device() {
            matrix_with(2, "64K", "verbs", &[("COLL_IB_QPS_PER_PEER", "3")]);
        }
    }

    // Grants with the registrations' keys, as on a device without windows.
    #[test]
    fn two_ranks_verbs_without_memory_windows() {
        if has_rdma_device() {
            matrix_with(2, "64K", "verbs", &[("COLL_IB_WINDOWS", "0")]);
        }
    }

    #[test]
    fn four_ranks_verbs_direct() {
        if has_rdma_device() {
            matrix_with(4, "64K", "verbs", &[DIRECT]);
        }
    }

    // Bruck's scratch buffer is registered with the device like the caller's.
    #[test]
    fn three_ranks_verbs_rabenseifner_bruck() {
        if has_rdma_device() {
            matrix_with(3, "64K", "verbs", &[LOG_ROUNDS]);
        }
    }
}
