//! The simulator against measurement, where we can measure: network
//! namespace "hosts" (TCP through a bridge between them, shared memory
//! within). Link and shared-memory figures are calibrated from 2-rank runs
//! (8 B for latency, 16 MiB for bandwidth); then every AllReduce algorithm
//! at 2 hosts x 2 ranks and 4 hosts x 1 rank is measured and predicted. A
//! test binary of its own, so no other test shares the cores while it
//! measures.

use std::path::Path;
use std::time::Duration;

use integration_tests::{run, Hosts};

fn collbench() -> String {
    integration_tests::sibling(env!("CARGO_BIN_EXE_coll-worker"), "collbench")
}

const SIZES: [u64; 3] = [8, 64 << 10, 4 << 20];
const ALGORITHMS: [&str; 5] = ["ring", "direct", "tree", "rabenseifner", "hierarchical"];

/// Time per call (us) by size, from a collbench or collbench simulate table
/// (`column`: where the time is).
fn times(table: &str, column: usize) -> Vec<(u64, f64)> {
    (table.lines())
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((f.first()?.parse().ok()?, f.get(column)?.parse().ok()?))
        })
        .collect()
}

/// `per_host` ranks on each host, torchrun-style; rank 0's table.
fn across(hosts: &Hosts, per_host: usize, port: u16, args: &str) -> String {
    let cmd = format!("{} allreduce -c 0 {args}", collbench());
    let runs = hosts.torchrun(per_host, port, &cmd);
    for r in &runs[1..] {
        assert!(r.ok, "{}", r.stderr);
    }
    assert!(runs[0].ok, "{}\n{}", runs[0].stdout, runs[0].stderr);
    runs[0].stdout.clone()
}

fn local(args: &str) -> String {
    let args: Vec<&str> = args.split_whitespace().collect();
    let r = run(
        Path::new(&collbench()),
        &args,
        &[],
        Duration::from_secs(300),
    );
    assert!(r.ok, "{}", r.stderr);
    r.stdout
}

/// Latency (s) and bandwidth (bytes/s) of a 2-rank ring AllReduce's table:
/// at 8 B it is two messages one after the other, at 16 MiB each rank
/// sends the whole buffer (halves, twice).
fn calibrate(table: &str) -> (f64, f64) {
    let t = times(table, 4);
    let (small, large) = (t[0].1 * 1e-6, t[1].1 * 1e-6);
    (small / 2.0, (16 << 20) as f64 / large)
}

/// Link and shared-memory figures measured on two hosts.
struct Calibration {
    link_latency: f64,
    link_bw: f64,
    intra_latency: f64,
    intra_bw: f64,
}

fn calibration(hosts: &Hosts) -> Calibration {
    let sizes = "--size 8,16M --iters 200 -w 20";
    // The best of three runs: a busy moment only ever makes a run slower
    // (once, another job's build made the 8 B latency 100x).
    let best = |runs: Vec<(f64, f64)>| {
        (runs.iter()).fold((f64::INFINITY, 0.0), |(l, b), r| {
            (l.min(r.0), f64::max(b, r.1))
        })
    };
    let (link_latency, link_bw) = best(
        (0..3)
            .map(|i| {
                calibrate(&across(
                    hosts,
                    1,
                    29721 + i,
                    &format!("--algo ring {sizes}"),
                ))
            })
            .collect(),
    );
    let shm = format!("allreduce -n 2 --transport shm --algo ring -c 0 {sizes}");
    let (intra_latency, intra_bw) = best((0..3).map(|_| calibrate(&local(&shm))).collect());
    println!(
        "calibrated: tcp {:.1} us, {:.2} GB/s; shm {:.1} us, {:.2} GB/s",
        link_latency * 1e6,
        link_bw * 1e-9,
        intra_latency * 1e6,
        intra_bw * 1e-9
    );
    Calibration {
        link_latency,
        link_bw,
        intra_latency,
        intra_bw,
    }
}

/// Every algorithm of `algorithms` measured with `per_host` ranks on each
/// of `hosts` and predicted with `c`; predicted / measured per point.
fn compare(
    hosts: &Hosts,
    per_host: usize,
    algorithms: &[&str],
    c: &Calibration,
    port: u16,
) -> Vec<f64> {
    let ranks = per_host * hosts.names.len();
    let list = SIZES.map(|s| s.to_string()).join(",");
    let mut ratios = Vec::new();
    println!("{} hosts x {per_host} ranks", hosts.names.len());
    println!(
        "{:<14} {:>9} {:>12} {:>12} {:>7}",
        "algorithm", "size", "measured us", "predicted us", "ratio"
    );
    for (i, algo) in algorithms.iter().enumerate() {
        let measured = times(
            &across(
                hosts,
                per_host,
                port + i as u16,
                &format!("--algo {algo} --size {list}"),
            ),
            4,
        );
        let predicted = times(
            &local(&format!(
                "simulate allreduce --ranks {ranks} --ranks-per-host {per_host} --transport tcp --algo {algo} --size {list} \
                 --link {}G --link-latency {}us --intra {}G --intra-latency {}us --overhead 0 --reduce-bw 1T",
                c.link_bw * 8e-9,
                c.link_latency * 1e6,
                c.intra_bw * 8e-9,
                c.intra_latency * 1e6
            )),
            3,
        );
        assert_eq!(measured.len(), SIZES.len(), "{algo}: {measured:?}");
        assert_eq!(predicted.len(), SIZES.len(), "{algo}: {predicted:?}");
        for ((size, m), (_, p)) in measured.iter().zip(&predicted) {
            let ratio = p / m;
            println!("{algo:<14} {size:>9} {m:>12.1} {p:>12.1} {ratio:>7.2}");
            ratios.push(ratio);
        }
    }
    ratios
}

/// One test, so the two setups never measure at once.
#[test]
fn predictions_for_two_and_four_hosts_are_within_a_factor_of_measurement() {
    let Some(two) = Hosts::new(2) else { return };
    let c = calibration(&two);
    let mut ratios = compare(&two, 2, &ALGORITHMS, &c, 29731);
    drop(two);
    // One rank per host: hierarchical would be the flat ring.
    let four = Hosts::new(4).expect("two hosts could be made");
    ratios.extend(compare(&four, 1, &ALGORITHMS[..4], &c, 29741));
    ratios.sort_by(f64::total_cmp);
    let median = ratios[ratios.len() / 2];
    let worst = ratios.iter().map(|r| r.max(1.0 / r)).fold(1.0, f64::max);
    println!("predicted / measured: median {median:.2}, worst {worst:.1}x off");
    // Generous: this machine's 2 cores run 4 ranks plus the kernel's TCP;
    // the model knows nothing of cores shared. The worst point seen is
    // direct at 8 B on 4 single-rank hosts, 9x (every rank's three sends
    // at once: the model posts them for free, 2 cores do not), 9-14x.
    assert!((0.25..=4.0).contains(&median), "median ratio {median}");
    assert!(worst <= 30.0, "a prediction {worst}x off");
}
