//! `collbench trace DIR`: merges the flight records the ranks dumped
//! (`coll-trace-rank<R>-pid<P>.json`, written on a failure, on SIGUSR1 or on
//! request) into one table, which rank is at which call and what it waits
//! on, and names the rank at fault: one that left no dump while others
//! wait for it (stopped, killed, unreachable), one that is behind the others
//! (it never entered the call they are in), or one that called something
//! else at the same point.

use std::collections::BTreeMap;
use std::path::Path;

use collectives::observe::status::{verdict as verdict_of, Position, RankState};
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
    /// Its newest collective call, done or not.
    last_collective: Option<Value>,
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
        let calls = v["calls"].as_array();
        let current = calls.and_then(|c| c.iter().rev().find(|c| c["state"] != "done").cloned());
        let last_collective =
            calls.and_then(|c| c.iter().rev().find(|c| c["peer"].is_null()).cloned());
        let dump = RankDump {
            rank: number("rank") as usize,
            size: number("size") as usize,
            host: v["host"].as_str().unwrap_or("?").to_string(),
            pid: number("pid"),
            reason: v["reason"].as_str().unwrap_or("").to_string(),
            current,
            last_collective,
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

/// Who is at fault, in one sentence (the same reasoning a rank applies
/// when its call times out and it asks the others).
fn verdict(dumps: &BTreeMap<usize, RankDump>, size: usize) -> String {
    let states: Vec<RankState> = (0..size)
        .map(|rank| RankState {
            rank,
            position: dumps.get(&rank).map(position),
        })
        .collect();
    verdict_of(&states, "left no record")
}

/// A dump as a position: its newest collective, and what its current call
/// waits on (from the call, else from the failure it dumped for).
fn position(d: &RankDump) -> Position {
    let last = d.last_collective.as_ref();
    let text = |v: Option<&Value>, k: &str| v.and_then(|c| c[k].as_str()).map(str::to_string);
    let waiting_on = (d.current.as_ref())
        .and_then(|c| c["waiting_on"]["peer"].as_u64())
        .map(|p| p as usize)
        .or_else(|| {
            let after = d.reason.split("peer rank ").nth(1)?;
            after
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        });
    Position {
        call: text(last, "call"),
        seq: last.and_then(|c| c["seq"].as_u64()).unwrap_or(0) as u32,
        state: text(last, "state").unwrap_or_default(),
        waiting_on,
        waiting_for: None,
    }
}
