//! collbench end to end: real ranks, real sockets, checked results, and the
//! JSON a script would read.

use std::path::Path;
use std::time::Duration;

use integration_tests::{free_port, run, Run};
use serde_json::Value;

fn collbench(args: &[&str]) -> Run {
    let exe = Path::new(env!("CARGO_BIN_EXE_collbench"));
    run(exe, args, &[], Duration::from_secs(300))
}

/// Runs a checked sweep with `--json -` and returns the document.
fn sweep(args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["-c", "1", "--json", "-"]);
    let r = collbench(&all);
    assert!(
        r.ok,
        "collbench {args:?} failed:\n{}\n{}",
        r.stdout, r.stderr
    );
    // With --json -, stdout holds the JSON and the table goes to stderr.
    assert!(
        r.stderr.contains("# Out of bounds values : 0 OK"),
        "{}",
        r.stderr
    );
    serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("bad JSON ({e}):\n{}", r.stdout))
}

fn rows(doc: &Value) -> &Vec<Value> {
    doc["rows"].as_array().unwrap()
}

#[test]
fn allreduce_sweep_is_clean_and_complete() {
    let doc = sweep(&[
        "allreduce",
        "-n",
        "4",
        "-b",
        "8",
        "-e",
        "4M",
        "-f",
        "8",
        "--transport",
        "tcp",
    ]);
    assert_eq!(doc["nranks"], 4);
    assert_eq!(doc["transport"], "tcp");
    assert_eq!(doc["summary"]["wrong"], 0);
    let sizes: Vec<u64> = rows(&doc)
        .iter()
        .map(|r| r["bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [8, 64, 512, 4096, 32768, 262144, 2097152]);
    for r in rows(&doc) {
        for mode in ["out_of_place", "in_place"] {
            assert_eq!(r[mode]["wrong"], 0);
            assert!(r[mode]["time_us"].as_f64().unwrap() > 0.0);
        }
        // busbw = algbw * 2(n-1)/n
        let m = &r["out_of_place"];
        let ratio = m["busbw_gbs"].as_f64().unwrap() / m["algbw_gbs"].as_f64().unwrap();
        assert!((ratio - 1.5).abs() < 1e-9, "busbw/algbw = {ratio}");
    }
}

#[test]
fn alltoall_sweep_is_clean() {
    let doc = sweep(&[
        "alltoall", "-n", "3", "-b", "12", "-e", "3M", "-f", "16", "-d", "bf16",
    ]);
    for r in rows(&doc) {
        // Counts are whole blocks per rank.
        assert_eq!(r["count"].as_u64().unwrap() % 3, 0);
        let m = &r["in_place"];
        if m["algbw_gbs"].as_f64().unwrap() > 0.0 {
            let ratio = m["busbw_gbs"].as_f64().unwrap() / m["algbw_gbs"].as_f64().unwrap();
            assert!((ratio - 2.0 / 3.0).abs() < 1e-9, "busbw/algbw = {ratio}");
        }
    }
}

#[test]
fn fresh_inputs_are_rewritten_not_changed() {
    // The checked call goes through the rewrite too: a rewrite that changed
    // a value would show as wrong elements.
    for (coll, extra) in [
        ("allgather", "bf16"),
        ("broadcast", "int8"),
        ("reduce", "double"),
    ] {
        let r = collbench(&[
            coll,
            "-n",
            "2",
            "--size",
            "8,1000,64K,1M",
            "-d",
            extra,
            "--fresh",
            "-c",
            "1",
        ]);
        assert!(r.ok, "{coll}: {}\n{}", r.stdout, r.stderr);
        assert!(
            r.stdout.contains("# Out of bounds values : 0 OK"),
            "{}",
            r.stdout
        );
        assert!(
            r.stdout
                .contains("inputs rewritten before each call (--fresh)"),
            "{}",
            r.stdout
        );
    }
}

/// With `--shared-buffers`, peers read large messages through mappings of
/// each other's buffers: every collective checks clean at sizes below and
/// above the single-copy threshold, odd ones included, at 3 ranks.
#[test]
fn shared_buffers_check_clean_for_every_collective() {
    for coll in [
        "allreduce",
        "alltoall",
        "allgather",
        "broadcast",
        "reducescatter",
        "reduce",
    ] {
        let doc = sweep(&[coll, "-n", "3", "--size", "8,100001,3M", "--shared-buffers"]);
        assert_eq!(doc["shared_buffers"], true, "{coll}");
        assert_eq!(doc["summary"]["wrong"], 0, "{coll}");
        assert_eq!(rows(&doc).len(), 3, "{coll}");
    }
}

#[test]
fn every_dtype_and_op_checks_clean() {
    for dtype in [
        "float", "double", "half", "bfloat16", "int8", "uint8", "int32", "uint32", "int64",
        "uint64",
    ] {
        for op in ["sum", "prod", "min", "max", "avg"] {
            let doc = sweep(&[
                "allreduce",
                "-n",
                "3",
                "-b",
                "1",
                "-e",
                "300K",
                "-f",
                "17",
                "-d",
                dtype,
                "-o",
                op,
                "--chunk",
                "16K",
            ]);
            assert_eq!(doc["summary"]["wrong"], 0, "{dtype} {op}");
        }
    }
}

#[test]
fn ranks_started_by_hand_form_one_job() {
    let exe = Path::new(env!("CARGO_BIN_EXE_collbench"));
    let port = free_port().to_string();
    let env = |rank: &'static str| {
        let port = port.clone();
        move || {
            let vars = [
                ("RANK", rank),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", port.as_str()),
            ];
            run(
                exe,
                &["allreduce", "-b", "1K", "-e", "64K", "-f", "8", "-c", "1"],
                &vars,
                Duration::from_secs(60),
            )
        }
    };
    let r1 = std::thread::spawn(env("1"));
    let r0 = env("0")();
    let r1 = r1.join().unwrap();
    assert!(r0.ok && r1.ok, "{}\n{}", r0.stderr, r1.stderr);
    assert!(
        r0.stdout
            .contains("2 ranks (environment (RANK, WORLD_SIZE))"),
        "{}",
        r0.stdout
    );
    assert!(r0.stdout.contains("# Out of bounds values : 0 OK"));
    assert!(r1.stdout.is_empty(), "only rank 0 prints: {}", r1.stdout);
}

#[test]
fn bad_requests_fail_with_a_message() {
    let r = collbench(&[
        "allreduce",
        "-n",
        "2",
        "--algo",
        "nosuch",
        "-b",
        "8",
        "-e",
        "8",
    ]);
    assert!(!r.ok);
    assert!(
        r.stderr.contains(
            "no allreduce algorithm named 'nosuch' (available: ring, direct, tree, hierarchical, rabenseifner)"
        ),
        "{}",
        r.stderr
    );
    let r = collbench(&["broadcast", "-n", "2", "--root", "5", "--size", "8"]);
    assert!(!r.ok);
    assert!(
        r.stderr
            .contains("broadcast: root 5 is not a rank of the 2"),
        "{}",
        r.stderr
    );
    let r = collbench(&["allreduce", "-n", "2", "--size", "1Q"]);
    assert!(!r.ok);
    assert!(r.stderr.contains("not a size"), "{}", r.stderr);
    let r = collbench(&["allreduce", "-n", "2", "-d", "complex"]);
    assert!(!r.ok);
    assert!(r.stderr.contains("unknown datatype"), "{}", r.stderr);
}

#[test]
fn help_teaches() {
    let r = collbench(&["allreduce", "--help"]);
    assert!(r.ok);
    for needle in [
        "--nranks",
        "--minbytes",
        "--stepfactor",
        "--check",
        "--dtype",
        "--json",
        "busbw",
        "mpirun",
        "COLL_DEBUG",
    ] {
        assert!(
            r.stdout.contains(needle),
            "--help lacks {needle}:\n{}",
            r.stdout
        );
    }
    let r = collbench(&["algorithms"]);
    assert!(
        r.ok && r.stdout.contains("ring") && r.stdout.contains("pairwise"),
        "{}",
        r.stdout
    );
}

/// Requests the machine cannot serve fail at once, before any rank starts,
/// with a message that says what to change (exit status 2).
#[test]
fn impossible_requests_fail_at_once_with_a_reason() {
    let cases: [(&[&str], &str); 8] = [
        (&["allreduce", "-n", "2", "--size", "1T"], "of memory"),
        (
            &["allreduce", "-n", "2", "--chunk", "4T"],
            "not between 64 bytes and 1G",
        ),
        (
            &["allreduce", "-n", "2", "-b", "8", "-e", "1M", "-f", "nan"],
            "step factor",
        ),
        (&["alltoallv", "-n", "4", "--size", "8G"], "of memory"),
        (
            &["allreduce", "-n", "100000", "--size", "8"],
            "--oversubscribe",
        ),
        (
            &["allreduce", "-n", "2", "--chunk", "0"],
            "chunk size (COLL_CHUNK) 0",
        ),
        (
            &["allreduce", "-n", "2", "--depth", "0"],
            "pipeline depth 0",
        ),
        (
            &["broadcast", "-n", "2", "-r", "5"],
            "broadcast: root 5 is not a rank",
        ),
    ];
    for (args, says) in cases {
        let r = collbench(args);
        assert!(
            !r.ok && r.stderr.contains(says),
            "collbench {args:?}:\n{}",
            r.stderr
        );
        assert!(
            r.elapsed < Duration::from_secs(2),
            "collbench {args:?} took {:?}",
            r.elapsed
        );
        assert!(
            !r.stdout.contains("# collbench"),
            "collbench {args:?} started ranks"
        );
    }
}

/// COLL_TRACE writes one Chrome trace-event file with every rank: a span
/// per call and per message, valid JSON that Perfetto opens.
#[test]
fn coll_trace_writes_a_chrome_trace_of_every_rank() {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("trace.json");
    let _ = std::fs::remove_file(&path);
    let exe = Path::new(env!("CARGO_BIN_EXE_collbench"));
    let env = [("COLL_TRACE", path.to_str().unwrap())];
    let args = [
        "allreduce",
        "-n",
        "3",
        "--size",
        "4M",
        "--chunk",
        "256K",
        "--iters",
        "2",
        "-w",
        "0",
    ];
    let r = run(exe, &args, &env, Duration::from_secs(120));
    assert!(r.ok, "{}", r.stderr);
    let doc: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).expect("valid JSON");
    let events = doc["traceEvents"].as_array().unwrap();
    let spans: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    for rank in 0..3 {
        let mine = |name: &str| {
            spans
                .iter()
                .any(|e| e["pid"] == rank && e["name"].as_str().unwrap().starts_with(name))
        };
        assert!(mine("allreduce #"), "rank {rank}: no call span");
        assert!(
            mine("send to ") && mine("receive from "),
            "rank {rank}: no message spans"
        );
        assert!(mine("reduce"), "rank {rank}: no reduction spans");
    }
    assert!(spans
        .iter()
        .all(|e| e["dur"].as_f64().unwrap() >= 0.0 && e["ts"].as_f64().unwrap() > 1e15));
}

/// `collbench plot` draws one series per result file, labelled, as SVG and
/// as PNG; a file that is not a result is refused with its name.
#[test]
fn plot_draws_every_result_file() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("plot");
    std::fs::create_dir_all(&dir).unwrap();
    let ours = dir.join("ours.json");
    let r = collbench(&[
        "allreduce",
        "-n",
        "2",
        "-b",
        "8",
        "-e",
        "64K",
        "-f",
        "64",
        "--json",
        ours.to_str().unwrap(),
    ]);
    assert!(r.ok, "{}", r.stderr);
    // Another library's results in the same shape, with a label of its own.
    let theirs = dir.join("theirs.json");
    let doc = r#"{"collective":"allreduce","label":"Open MPI, 2 ranks","rows":[
        {"bytes":8,"out_of_place":{"time_us":2.0,"busbw_gbs":0.004}},
        {"bytes":65536,"out_of_place":{"time_us":30.0,"busbw_gbs":2.2}}]}"#;
    std::fs::write(&theirs, doc).unwrap();
    let files = [ours.to_str().unwrap(), theirs.to_str().unwrap()];
    let svg = dir.join("chart.svg");
    let r = collbench(&["plot", files[0], files[1], "-o", svg.to_str().unwrap()]);
    assert!(r.ok, "{}", r.stderr);
    let text = std::fs::read_to_string(&svg).unwrap();
    for label in [
        "collectives, shm, 2 ranks",
        "Open MPI, 2 ranks",
        "allreduce: bus bandwidth",
        "64 KiB",
    ] {
        assert!(text.contains(label), "{label} missing from the chart");
    }
    let png = dir.join("chart.png");
    let r = collbench(&["plot", files[0], files[1], "-o", png.to_str().unwrap()]);
    assert!(r.ok, "{}", r.stderr);
    assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG");
    let r = collbench(&["plot", svg.to_str().unwrap()]);
    assert!(!r.ok && r.stderr.contains("chart.svg"), "{}", r.stderr);
}
