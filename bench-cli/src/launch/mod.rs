//! Starting a job on this host: `collbench -n N` runs N ranks of this very
//! command through the library's launcher, after checking everything it
//! can first (`preflight`), and merges the ranks' traces afterwards.

pub(crate) mod preflight;

use collectives::bootstrap::launch;
use collectives::Collective;

use crate::cli::BenchArgs;
use crate::settings::{check_args, config, timeout};
use crate::{FAILED, WRONG_VALUES};

/// Starts `n` ranks of this very command and waits for them; the exit status
/// is the ranks' (1: wrong values only, 2: a rank failed). Every argument,
/// the rank count and the memory are checked before anything starts.
pub(crate) fn launch_local(
    collective: Collective,
    n: usize,
    args: &BenchArgs,
) -> Result<u8, String> {
    let config = config(collective, args)?;
    check_args(collective, args, n)?;
    preflight::check_launch(collective, args, n, &config)?;
    let job = launch::Launch {
        nranks: n,
        program: std::env::current_exe()
            .map_err(|e| format!("cannot find my own executable: {e}"))?,
        args: std::env::args_os().skip(1).collect(),
        env: Vec::new(),
        timeout: timeout(args)?,
        bind: match &args.bind {
            Some(b) => launch::Bind::parse(b)?,
            None => launch::Bind::from_env()?,
        },
    };
    let outcome = launch::run(&job)?;
    for f in &outcome.failures {
        collectives::log::eprint_line(&format!("collbench: {f}"));
    }
    if let Some(path) = std::env::var("COLL_TRACE")
        .ok()
        .filter(|p| !p.contains("{rank}") && !p.is_empty())
    {
        merge_traces(&path, n)?;
    }
    Ok(match outcome.worst_status {
        0 => 0,
        WRONG_VALUES => WRONG_VALUES,
        _ => FAILED,
    })
}

/// Merges the ranks' Chrome traces (`<path>.rank<R>.json`) into `<path>`:
/// one file, one process per rank.
fn merge_traces(path: &str, n: usize) -> Result<(), String> {
    let mut events = Vec::new();
    for rank in 0..n {
        let part = format!("{path}.rank{rank}.json");
        let Ok(text) = std::fs::read_to_string(&part) else {
            continue; // a rank that failed may have written none
        };
        let doc: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{part}: {e}"))?;
        if let Some(list) = doc["traceEvents"].as_array() {
            events.extend(list.iter().cloned());
        }
        let _ = std::fs::remove_file(&part);
    }
    let doc = serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"});
    std::fs::write(path, serde_json::to_vec(&doc).map_err(|e| e.to_string())?)
        .map_err(|e| format!("COLL_TRACE: cannot write {path}: {e}"))
}
