use super::*;

/// Predicted seconds for `name`'s call of `bytes` (f32, default pipeline).
fn seconds(c: &Cluster, collective: Collective, name: &str, bytes: usize) -> f64 {
    let algo = algo::find(collective, name).unwrap();
    (simulate(c, algo, bytes, DataType::F32, Pipeline::default()).unwrap()).seconds
}

/// A cluster with one cost at a time: only latency, or only bandwidth.
fn bare(ranks: usize, per_host: usize) -> Cluster {
    Cluster {
        overhead: 0.0,
        reduce_bandwidth: 1e18,
        link: Link {
            bandwidth: 1e10,
            latency: 0.0,
        },
        intra: Link {
            bandwidth: 1e18,
            latency: 0.0,
        },
        ..Cluster::roce(ranks, per_host)
    }
}

fn close(got: f64, want: f64, tolerance: f64) -> bool {
    (got - want).abs() <= tolerance * want
}

#[test]
fn ring_allreduce_moves_2_n_minus_1_over_n_of_the_buffer_per_link() {
    let bytes = 256 << 20;
    for n in [2, 4, 8] {
        let c = bare(n, 1);
        let got = seconds(&c, Collective::AllReduce, "ring", bytes);
        let want = 2.0 * (n - 1) as f64 / n as f64 * bytes as f64 / c.link.bandwidth;
        assert!(close(got, want, 0.02), "{n} ranks: {got} s, model {want} s");
    }
}

#[test]
fn latency_bound_calls_pay_their_algorithms_hop_counts() {
    // 8 B on 8 hosts, latency L only. Every message waits for its
    // receiver's clear-to-send (L), then takes L. The ring's receives are
    // posted ahead, so after the first its 2(n-1) steps cost L each: 15 L.
    // Direct posts 4 of its 7 receives (4 staging slots): 2 L, then 2 L
    // for the other 3.
    let mut c = bare(8, 1);
    c.link.latency = 1e-6;
    let time = |name| seconds(&c, Collective::AllReduce, name, 8);
    assert!(close(time("ring"), 15e-6, 0.01), "ring {}", time("ring"));
    assert!(
        close(time("direct"), 4e-6, 0.01),
        "direct {}",
        time("direct")
    );
    // Up a tree of depth 4 (8 ranks in order) and down again, 2 trees at
    // once: at most 2 x 4 hops plus the first clear-to-send.
    let tree = time("tree");
    assert!((6e-6..=9e-6).contains(&tree), "tree {tree}");
}

#[test]
fn a_hosts_ranks_share_its_nic() {
    // AllToAll, 2 hosts x 4 ranks: each NIC carries 16 blocks each way.
    let bytes = 64 << 20;
    let c = bare(8, 4);
    let got = seconds(&c, Collective::AllToAll, "pairwise", bytes);
    let want = 16.0 * (bytes / 8) as f64 / c.link.bandwidth;
    assert!(close(got, want, 0.05), "{got} s, model {want} s");
}

#[test]
fn every_algorithm_finishes_at_every_size_and_shape() {
    for a in algo::ALGORITHMS
        .iter()
        .filter(|a| a.collective != Collective::AllToAllV)
    {
        for (n, per_host) in [(1, 1), (2, 1), (3, 1), (5, 2), (8, 4), (12, 4)] {
            let c = Cluster::roce(n, per_host);
            for bytes in [0, 4, 36, 4 * 1001, 3 << 20] {
                let p = Pipeline {
                    chunk: 1 << 20,
                    depth: 2,
                };
                let r = simulate(&c, a, bytes, DataType::F32, p);
                let r = r.unwrap_or_else(|e| {
                    panic!("{} {}: {n} ranks, {bytes} B: {e}", a.collective, a.name)
                });
                assert!(r.seconds.is_finite() && r.seconds >= 0.0);
            }
        }
    }
}

#[test]
fn hierarchical_takes_fewer_hops_in_a_row_than_the_flat_ring() {
    // 4 hosts x 8 ranks, 256 KiB: a block of the flat ring passes 62 hops
    // one after the other (8 of them across the network); the
    // hierarchical one's pass 7 + 6 + 7.
    let c = Cluster::roce(32, 8);
    let bytes = 256 << 10;
    let time = |name| seconds(&c, Collective::AllReduce, name, bytes);
    let (ring, hier) = (time("ring"), time("hierarchical"));
    assert!(hier < ring, "hierarchical {hier} s, ring {ring} s");
}

#[test]
fn without_a_profile_many_ranks_get_the_simulators_fastest() {
    let pipeline = Pipeline::default();
    let pick = |ranks, bytes| {
        let (a, why) = unprofiled_choice(ranks, 8, true, Collective::AllReduce, bytes, pipeline);
        (a.name, why)
    };
    // Where the table read off the simulator missed: the ring at 64 ranks
    // and 256 MiB (by 19%), Rabenseifner at 512 ranks and 1 MiB (by 12%).
    let (name, why) = pick(64, 256 << 20);
    assert_eq!(name, "ring", "{why}");
    assert!(why.contains("simulator's pick on 64 ranks"), "{why}");
    assert_eq!(pick(512, 1 << 20).0, "rabenseifner");
    // A size between powers of two is simulated at the next one.
    assert!(pick(64, 3 << 20).1.contains("(at 4194304 B)"));
    // Fewer ranks than [`algo::SCALE_MIN_RANKS`]: the measured thresholds.
    let (a, _) = algo::select(
        Collective::AllReduce,
        8,
        &Topology::new(Cluster::roce(16, 8).host_ranks()),
    );
    assert_eq!(pick(16, 8).0, a.name);
    // Too large to simulate while choosing: the table, saying so.
    let (name, why) = pick(4096, 1 << 30);
    assert!(why.contains("too large to simulate"), "{why}");
    let table = algo::select(
        Collective::AllReduce,
        1 << 30,
        &Topology::new(Cluster::roce(4096, 8).host_ranks()),
    );
    assert_eq!(name, table.0.name);
    // AllToAll on many ranks: Bruck for tiny blocks, as the table says.
    let (a, _) = unprofiled_choice(512, 8, true, Collective::AllToAll, 8 << 10, pipeline);
    assert_eq!(a.name, "bruck");
}
