//! `collbench trace DIR`: merges the flight records the ranks dumped
//! (`coll-trace-rank<R>-pid<P>.json`, written on a failure, on SIGUSR1 or on
//! request) into one table, which rank is at which call and what it waits
//! on, and names the rank at fault: one that left no dump while others
//! wait for it (stopped, killed, unreachable), one that is behind the others
//! (it never entered the call they are in), or one that called something
//! else at the same point.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

/// One rank's latest dump.
struct RankDump {
    rank: usize,
    size: usize,
    host: String,
    pid: u64,
    reason: String,
    /// Its current call: the last that is not done.
    current: Option<Value>,
}

pub fn run(dir: &Path) -> Result<String, String> {
    let dumps = read(dir)?;
    let size = dumps.values().map(|d| d.size).max().ok_or_else(|| {
        format!(
            "no flight records (coll-trace-rank*.json) in {}",
            dir.display()
        )
    })?;
    let mut out = String::new();
    out += &format!(
        "# flight records in {}: {} of {size} ranks\n",
        dir.display(),
        dumps.len()
    );
    out += &format!(
        "# {:>4}  {:<10} {:>8}  {:<44} {:<34} {}\n",
        "rank", "host", "pid", "call", "waiting on", "dumped because"
    );
    for rank in 0..size {
        match dumps.get(&rank) {
            None => out += &format!("  {rank:>4}  (no record)\n"),
            Some(d) => {
                let (call, waits) = describe(d.current.as_ref());
                let reason: String = d.reason.chars().take(60).collect();
                out += &format!(
                    "  {:>4}  {:<10} {:>8}  {:<44} {:<34} {reason}\n",
                    d.rank, d.host, d.pid, call, waits
                );
            }
        }
    }
    out += &format!("verdict: {}\n", verdict(&dumps, size));
    Ok(out)
}

/// The latest dump of each rank in `dir`.
fn read(dir: &Path) -> Result<BTreeMap<usize, RankDump>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut latest: BTreeMap<usize, (f64, RankDump)> = BTreeMap::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("coll-trace-rank") || !name.ends_with(".json") {
            continue;
        }
        let text = std::fs::read_to_string(entry.path()).map_err(|e| format!("{name}: {e}"))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("{name}: {e}"))?;
        let number = |k: &str| v[k].as_u64().unwrap_or(0);
        let current = (v["calls"].as_array())
            .and_then(|calls| calls.iter().rev().find(|c| c["state"] != "done").cloned());
        let dump = RankDump {
            rank: number("rank") as usize,
            size: number("size") as usize,
            host: v["host"].as_str().unwrap_or("?").to_string(),
            pid: number("pid"),
            reason: v["reason"].as_str().unwrap_or("").to_string(),
            current,
        };
        let time = v["time"].as_f64().unwrap_or(0.0);
        if latest.get(&dump.rank).is_none_or(|(t, _)| *t < time) {
            latest.insert(dump.rank, (time, dump));
        }
    }
    Ok(latest.into_iter().map(|(r, (_, d))| (r, d)).collect())
}

/// A current call as the table shows it: the call, and what it waits on.
fn describe(current: Option<&Value>) -> (String, String) {
    let Some(c) = current else {
        return ("(no call in flight)".into(), String::new());
    };
    let mut call = c["call"].as_str().unwrap_or("?").to_string();
    if let Some(peer) = c["peer"].as_u64() {
        call += &format!(
            " {} {peer}",
            if c["direction"] == "send" {
                "to"
            } else {
                "from"
            }
        );
    }
    let state = c["state"].as_str().unwrap_or("?");
    let waits = match &c["waiting_on"] {
        Value::Object(w) => format!(
            "rank {} ({} {} of {})",
            w["peer"],
            w["kind"].as_str().unwrap_or("?"),
            w["message"],
            w["of"]
        ),
        _ => state.to_string(),
    };
    (call, waits)
}

/// Who is at fault, in one sentence.
fn verdict(dumps: &BTreeMap<usize, RankDump>, size: usize) -> String {
    let waited_on = |rank: usize| -> Vec<usize> {
        (dumps.values())
            .filter(|d| {
                d.current.as_ref().is_some_and(|c| {
                    c["waiting_on"]["peer"].as_u64() == Some(rank as u64)
                        || d.reason.contains(&format!("peer rank {rank} "))
                })
            })
            .map(|d| d.rank)
            .collect()
    };
    let missing: Vec<usize> = (0..size).filter(|r| !dumps.contains_key(r)).collect();
    for &m in &missing {
        let waiters = waited_on(m);
        if !waiters.is_empty() {
            return format!(
                "rank {m} left no record while rank(s) {} wait for it: it is stopped, killed or unreachable (or in no call: its SIGUSR1 dump comes with its next call)",
                list(&waiters)
            );
        }
    }
    // Collectives in flight, by (seq, collective): the rank behind, or the
    // one that called something else at the same point.
    let at: Vec<(usize, u64, String)> = (dumps.values())
        .filter_map(|d| {
            let c = d.current.as_ref()?;
            (c["peer"].is_null()).then(|| {
                (
                    d.rank,
                    c["seq"].as_u64().unwrap_or(0),
                    c["call"].as_str().unwrap_or("?").to_string(),
                )
            })
        })
        .collect();
    if let Some(max_seq) = at.iter().map(|a| a.1).max() {
        // First, ranks that called something else at the furthest call (a
        // rank still finishing the call before, when the failure reached
        // it, is no evidence against it).
        let mut kinds: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for a in at.iter().filter(|a| a.1 == max_seq) {
            kinds.entry(a.2.as_str()).or_default().push(a.0);
        }
        if kinds.len() > 1 {
            let (odd, ranks) = kinds.iter().min_by_key(|(_, r)| r.len()).unwrap();
            let (usual, others) = kinds.iter().max_by_key(|(_, r)| r.len()).unwrap();
            return format!(
                "rank(s) {} called {odd} where rank(s) {} called {usual}: the ranks disagree on the call",
                list(ranks),
                list(others)
            );
        }
        let behind: Vec<&(usize, u64, String)> = at.iter().filter(|a| a.1 < max_seq).collect();
        let ahead: Vec<usize> = at.iter().filter(|a| a.1 == max_seq).map(|a| a.0).collect();
        if let (Some(b), Some(front)) = (behind.first(), at.iter().find(|a| a.1 == max_seq)) {
            return format!(
                "rank {} never entered {} (it is in {}); rank(s) {} wait for it",
                b.0,
                front.2,
                b.2,
                list(&ahead)
            );
        }
    }
    // Everyone at one call: the peer most waited on.
    let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
    for d in dumps.values() {
        if let Some(p) = d
            .current
            .as_ref()
            .and_then(|c| c["waiting_on"]["peer"].as_u64())
        {
            *counts.entry(p).or_default() += 1;
        }
    }
    match counts.into_iter().max_by_key(|(_, n)| *n) {
        Some((peer, _)) => format!("rank {peer} is the one the others wait for (see its line)"),
        None if missing.is_empty() => {
            "no rank is waiting: nothing is stuck in these records".into()
        }
        None => format!("no record from rank(s) {}", list(&missing)),
    }
}

fn list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
