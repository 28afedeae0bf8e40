//! Run-time settings, from code or from `COLL_*` environment variables.

use std::time::Duration;

use transport::shm::ShmOptions;

use transport::tcp::TcpOptions;

/// Settings of a communicator. `Config::from_env()` starts from the defaults
/// and applies the environment:
///
/// | variable | meaning | default |
/// |---|---|---|
/// | `COLL_TIMEOUT` | seconds a wait may see no progress before failing | 300 |
/// | `COLL_CHUNK` | pipeline chunk size, bytes (`K`/`M` suffixes) | 1M |
/// | `COLL_DEPTH` | chunks in flight per peer and direction | 4 |
/// | `COLL_ALGO` | force an algorithm, e.g. `ring` or `allreduce=ring,alltoall=pairwise` | selector |
/// | `COLL_TRANSPORT` | `auto` (shm within a host; verbs, else tcp, between hosts), `tcp`, `shm`, `verbs` | auto |
/// | `COLL_TCP_BUFFER` | socket buffer bytes (turns kernel autotuning off) | autotuned; the send buffer 512 KiB to a peer on the same host |
/// | `COLL_SHM_SINGLE_COPY` | `0`: copy every shared-memory byte through the rings, never `process_vm_readv` | 1 |
/// | `COLL_TINY` | small calls (AllReduce, Reduce, ReduceScatter, AllGather, AllToAll, Broadcast; up to this many bytes) and barriers among the ranks of one host run through shared flags, not messages (`K` suffix; 0: never; at most 1M) | 64K |
/// | `COLL_CONNECT` | `lazy`: a connection to a peer is made when a call first needs it; `eager`: to every peer when the communicator is made | lazy |
/// | `COLL_DEBUG` | log level: `WARN`, `INFO`, `DEBUG`, `TRACE` | WARN |
#[derive(Clone, Debug)]
pub struct Config {
    /// How long any wait may go without progress before it fails.
    pub timeout: Duration,
    /// Bytes per pipelined chunk (and per staging slot).
    pub chunk_bytes: usize,
    /// Chunks in flight per peer and direction; also the number of staging slots.
    pub depth: usize,
    /// Forced algorithms: `(collective or "*", algorithm name)`.
    pub algo: Vec<(String, String)>,
    /// `auto` (shared memory within a host, TCP between hosts) or a transport name.
    pub transport: String,
    pub tcp: TcpOptions,
    pub shm: ShmOptions,
    /// AllReduces, Reduces, ReduceScatters, AllGathers, AllToAlls and Broadcasts whose
    /// larger buffer has up to this many bytes, and barriers, among ranks of
    /// one host take the flag path (`tiny.rs`); 0: never.
    pub tiny_bytes: usize,
    /// Connect to every peer when the communicator is made, not when a
    /// call first needs the peer (`COLL_CONNECT=eager`).
    pub eager_connect: bool,
}

/// The default `tiny_bytes`. Measured: at 8-64 KiB the flag path took
/// 0.3-0.8x the general path's time at 2, 4 and 8 ranks (4-rank Broadcast
/// of 8 KiB: 1.1 against 13 us), and put every collective at 1.1-7x Open
/// MPI there.
pub const DEFAULT_TINY_BYTES: usize = 64 << 10;

/// The largest `tiny_bytes`: the flag path keeps at least 64 parts of this
/// size per rank in shared memory that every rank of the host maps.
pub const MAX_TINY: usize = 1 << 20;

/// The largest pipeline chunk (`COLL_CHUNK`).
pub const MAX_CHUNK: usize = 1 << 30;

impl Default for Config {
    fn default() -> Self {
        Config {
            timeout: Duration::from_secs(300),
            chunk_bytes: 1 << 20,
            depth: 4,
            algo: Vec::new(),
            transport: "auto".into(),
            tcp: TcpOptions::default(),
            shm: ShmOptions::default(),
            tiny_bytes: DEFAULT_TINY_BYTES,
            eager_connect: false,
        }
    }
}

impl Config {
    /// Defaults overridden by `COLL_*` variables; a malformed value is an error.
    pub fn from_env() -> Result<Self, String> {
        let mut c = Config::default();
        if let Some(v) = var("COLL_TIMEOUT") {
            c.timeout = parse_seconds(&v).map_err(|e| format!("COLL_TIMEOUT: {e}"))?;
        }
        if let Some(v) = var("COLL_CHUNK") {
            c.chunk_bytes = parse_size(&v).map_err(|e| format!("COLL_CHUNK: {e}"))? as usize;
        }
        if let Some(v) = var("COLL_DEPTH") {
            c.depth = v
                .parse()
                .map_err(|_| format!("COLL_DEPTH: '{v}' is not a number"))?;
        }
        if let Some(v) = var("COLL_ALGO") {
            c.algo = parse_algo(&v);
        }
        if let Some(v) = var("COLL_TRANSPORT") {
            c.transport = v;
        }
        if let Some(v) = var("COLL_TCP_BUFFER") {
            c.tcp.socket_buffer =
                Some(parse_size(&v).map_err(|e| format!("COLL_TCP_BUFFER: {e}"))? as usize);
        }
        if let Some(v) = var("COLL_TINY") {
            c.tiny_bytes = parse_size(&v).map_err(|e| format!("COLL_TINY: {e}"))? as usize;
        }
        if let Some(v) = var("COLL_CONNECT") {
            c.eager_connect = match v.as_str() {
                "lazy" => false,
                "eager" => true,
                _ => return Err(format!("COLL_CONNECT: '{v}' is neither 'lazy' nor 'eager'")),
            };
        }
        if let Some(v) = var("COLL_SHM_SINGLE_COPY") {
            c.shm.single_copy = !matches!(v.as_str(), "0" | "false" | "no" | "off");
        }
        c.validate()?;
        Ok(c)
    }

    pub fn validate(&self) -> Result<(), String> {
        if !(64..=MAX_CHUNK).contains(&self.chunk_bytes) {
            return Err(format!(
                "chunk size (COLL_CHUNK) {} is not between 64 bytes and 1G: every \
                 connection stages a depth of chunks",
                self.chunk_bytes
            ));
        }
        if !(1..=64).contains(&self.depth) {
            return Err(format!("pipeline depth {} is not in 1..=64", self.depth));
        }
        if self.tiny_bytes > MAX_TINY {
            return Err(format!(
                "COLL_TINY (tiny_bytes) {} is above 1M: its flag path keeps several times \
                 that in shared memory per rank, which every rank of the host maps",
                self.tiny_bytes
            ));
        }
        if self.timeout.is_zero() || self.timeout > MAX_TIMEOUT {
            return Err(format!(
                "timeout {:?} is not above 0 and at most a year",
                self.timeout
            ));
        }
        if !["auto", "tcp", "shm", "verbs"].contains(&self.transport.as_str()) {
            return Err(format!(
                "unknown transport '{}' (one of auto, tcp, shm, verbs)",
                self.transport
            ));
        }
        Ok(())
    }

    /// What every rank of a job must agree on, as text.
    pub(crate) fn shared_settings(&self) -> String {
        format!(
            "transport={} chunk={} tiny={}",
            self.transport, self.chunk_bytes, self.tiny_bytes
        )
    }

    /// The transport for a peer, given whether it shares our host and
    /// whether both ends have an RDMA device (both published a verbs
    /// address): the same answer at both ends of every pair.
    pub(crate) fn transport_for(
        &self,
        same_host: bool,
        both_verbs: bool,
    ) -> Result<&'static str, String> {
        match (self.transport.as_str(), same_host, both_verbs) {
            ("auto", true, _) | ("shm", true, _) => Ok("shm"),
            ("auto", false, true) | ("verbs", _, true) => Ok("verbs"),
            ("auto", false, false) | ("tcp", _, _) => Ok("tcp"),
            ("shm", false, _) => Err("the shm transport was forced, but not every rank is on this host".into()),
            _ => Err(
                "the verbs transport was forced, but a rank has no usable RDMA device (or a build without the verbs feature)".into(),
            ),
        }
    }
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// `ring` (every collective) or `allreduce=ring,alltoall=pairwise`.
pub fn parse_algo(v: &str) -> Vec<(String, String)> {
    v.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|item| match item.split_once('=') {
            Some((c, a)) => (c.trim().to_lowercase(), a.trim().to_lowercase()),
            None => ("*".into(), item.trim().to_lowercase()),
        })
        .collect()
}

/// `1000`, `64K`, `1M`, `1G`, `1.5G`, `4KiB` (binary multiples, as nccl-tests).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let body = lower
        .trim_end_matches("ib")
        .trim_end_matches('b')
        .trim_end();
    let (num, mult) = match body.chars().last() {
        Some('k') => (&body[..body.len() - 1], 1u64 << 10),
        Some('m') => (&body[..body.len() - 1], 1 << 20),
        Some('g') => (&body[..body.len() - 1], 1 << 30),
        Some('t') => (&body[..body.len() - 1], 1 << 40),
        _ => (body, 1),
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("'{t}' is not a size (examples: 8, 64K, 1M, 1G)"))?;
    if v.is_nan() || v < 0.0 || !v.is_finite() {
        return Err(format!("'{t}' is not a size"));
    }
    let bytes = v * mult as f64;
    if bytes > MAX_SIZE as f64 {
        return Err(format!("'{t}' is above the largest size, 1P"));
    }
    Ok(bytes.round() as u64)
}

/// The largest size [`parse_size`] takes (1 PiB): sizes are buffers or
/// chunks, and beyond this one is a typo that would overflow later.
pub const MAX_SIZE: u64 = 1 << 50;

/// The longest timeout (a year): beyond it, a deadline overflows the clock.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

/// Seconds, fractional allowed: `30`, `0.5`, `2s`; at most a year.
pub fn parse_seconds(s: &str) -> Result<Duration, String> {
    let t = s.trim().trim_end_matches('s');
    t.parse::<f64>()
        .map_err(|_| format!("'{s}' is not a number of seconds"))
        .and_then(seconds)
}

/// `v` seconds as a timeout: above 0 and at most a year (beyond, a
/// deadline overflows the clock); NaN and infinities are refused.
pub fn seconds(v: f64) -> Result<Duration, String> {
    match v > 0.0 && v <= MAX_TIMEOUT.as_secs_f64() {
        true => Ok(Duration::from_secs_f64(v)),
        false => Err(format!(
            "{v} is not a number of seconds above 0 and at most a year"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_nccl_tests() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("256MiB"), Ok(256 << 20));
        assert_eq!(parse_size("1.5k"), Ok(1536));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("1e30").is_err(), "wrapped to 0 bytes once");
        assert!(parse_size("1024T").is_ok() && parse_size("1025T").is_err());
        assert!(parse_seconds("1e19").is_err(), "overflowed the clock once");
        assert!(parse_seconds("nan").is_err() && parse_seconds("0").is_err());
        assert!(parse_seconds("86400").is_ok());
        let huge_chunk = Config {
            chunk_bytes: 4 << 40,
            ..Config::default()
        };
        assert!(huge_chunk.validate().is_err(), "aborted on allocation once");
    }

    #[test]
    fn a_flag_path_limit_above_1m_is_refused() {
        let at = |tiny_bytes| Config {
            tiny_bytes,
            ..Config::default()
        };
        assert!(at(MAX_TINY).validate().is_ok());
        let e = at(MAX_TINY + 1).validate().unwrap_err();
        assert!(e.contains("above 1M"), "{e}");
    }
}
