//! Chrome trace-event output (`COLL_TRACE=path`; Perfetto and
//! chrome://tracing open it): a span per call, per message from posted to
//! completed (one track per peer and direction), and per reduction or copy
//! of a landed chunk, so the pipeline's overlap shows. Off unless
//! `COLL_TRACE` is set (then one branch per posted message is all it costs).
//! Each rank writes `<path>.rank<R>.json` at exit (`{rank}` in the path is
//! replaced instead); `collbench -n` merges them into `<path>`.

use serde_json::{json, Value};
use transport::{Rank, Request};

use crate::sys::clock::ticks;

/// A finished span.
struct Span {
    name: String,
    track: u32,
    start: u64,
    end: u64,
    bytes: usize,
}

/// One rank's spans, in [`ticks`].
#[derive(Default)]
pub(crate) struct Timeline {
    spans: Vec<Span>,
    /// Messages posted and not yet seen complete: (lane, peer, request,
    /// started, send, bytes).
    open: Vec<(usize, Rank, Request, u64, bool, usize)>,
}

/// Where `COLL_TRACE` wants this rank's file, if tracing is on.
pub(crate) fn path_for(rank: Rank) -> Option<String> {
    let path = std::env::var("COLL_TRACE").ok().filter(|p| !p.is_empty())?;
    Some(match path.contains("{rank}") {
        true => path.replace("{rank}", &rank.to_string()),
        false => format!("{path}.rank{rank}.json"),
    })
}

impl Timeline {
    pub fn call(&mut self, name: String, start: u64, end: u64, bytes: usize) {
        self.spans.push(Span {
            name,
            track: 0,
            start,
            end,
            bytes,
        });
    }

    pub fn posted(&mut self, lane: usize, peer: Rank, request: Request, send: bool, bytes: usize) {
        self.open.push((lane, peer, request, ticks(), send, bytes));
    }

    pub fn completed(&mut self, lane: usize, peer: Rank, request: Request) {
        let Some(at) = (self.open.iter()).position(|o| (o.0, o.1, o.2) == (lane, peer, request))
        else {
            return;
        };
        let (_, peer, _, start, send, bytes) = self.open.swap_remove(at);
        let (name, track) = match send {
            true => (format!("send to {peer}"), 1 + 2 * peer as u32),
            false => (format!("receive from {peer}"), 2 + 2 * peer as u32),
        };
        self.spans.push(Span {
            name,
            track,
            start,
            end: ticks(),
            bytes,
        });
    }

    pub fn local(&mut self, name: &'static str, start: u64, bytes: usize) {
        self.spans.push(Span {
            name: name.to_string(),
            track: 0,
            start,
            end: ticks(),
            bytes,
        });
    }

    /// The spans as trace events of process `rank`, times in microseconds
    /// since the Unix epoch (`to_us` converts ticks), with track names.
    pub fn events(&self, rank: Rank, size: usize, to_us: impl Fn(u64) -> f64) -> Vec<Value> {
        let mut events = vec![
            json!({"ph": "M", "pid": rank, "name": "process_name", "args": {"name": format!("rank {rank}")}}),
        ];
        events.push(json!({"ph": "M", "pid": rank, "tid": 0, "name": "thread_name", "args": {"name": "calls"}}));
        for peer in (0..size).filter(|p| *p != rank) {
            for (track, what) in [(1 + 2 * peer, "send to"), (2 + 2 * peer, "receive from")] {
                events.push(json!({"ph": "M", "pid": rank, "tid": track, "name": "thread_name", "args": {"name": format!("{what} {peer}")}}));
            }
        }
        for s in &self.spans {
            let start = to_us(s.start);
            events.push(json!({
                "ph": "X", "pid": rank, "tid": s.track, "name": s.name,
                "ts": start, "dur": (to_us(s.end) - start).max(0.0),
                "args": {"bytes": s.bytes},
            }));
        }
        events
    }
}

/// Writes `events` as a Chrome trace file.
pub(crate) fn write(path: &str, events: Vec<Value>) -> std::io::Result<()> {
    let doc = json!({"traceEvents": events, "displayTimeUnit": "ms"});
    std::fs::write(
        path,
        serde_json::to_vec(&doc).map_err(std::io::Error::other)?,
    )
}
