//! The nccl-tests-style table and the JSON document; `plot` draws result
//! files as a chart.

pub(crate) mod plot;

use std::io::Write;
use std::path::Path;

use collectives::{DataType, ReduceOp};
use serde::Serialize;

/// Whether `--json` asks for the document on standard output (`-`).
pub(crate) fn json_to_stdout(json: Option<&Path>) -> bool {
    json.is_some_and(|p| p.as_os_str() == "-")
}

/// Where the human table goes: standard error when the JSON document goes
/// to standard output, else standard output.
pub(crate) fn table_out(json: Option<&Path>) -> Box<dyn Write> {
    match json_to_stdout(json) {
        true => Box::new(std::io::stderr()),
        false => Box::new(std::io::stdout()),
    }
}

/// Writes `doc` as JSON, pretty and ending in a newline, to `path` (`-`:
/// standard output).
pub(crate) fn write_json(path: &Path, doc: &impl Serialize) -> Result<(), String> {
    let text = serde_json::to_string_pretty(doc).map_err(|e| e.to_string())?;
    if json_to_stdout(Some(path)) {
        println!("{text}");
        return Ok(());
    }
    std::fs::write(path, text + "\n").map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// One measurement: a size in one mode (out-of-place or in-place).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Mode {
    pub time_us: f64,
    pub algbw_gbs: f64,
    pub busbw_gbs: f64,
    pub wrong: u64,
}

impl Mode {
    pub fn new(bytes: u64, seconds: f64, bus_factor: f64, wrong: u64) -> Self {
        let algbw = if seconds > 0.0 {
            bytes as f64 / seconds / 1e9
        } else {
            0.0
        };
        Mode {
            time_us: seconds * 1e6,
            algbw_gbs: algbw,
            busbw_gbs: algbw * bus_factor,
            wrong,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub bytes: u64,
    pub count: u64,
    #[serde(serialize_with = "dtype_name")]
    pub dtype: DataType,
    #[serde(serialize_with = "op_name")]
    pub op: Option<ReduceOp>,
    pub out_of_place: Mode,
    /// `None` where the collective has no in-place form (AllToAllv).
    pub in_place: Option<Mode>,
}

fn dtype_name<S: serde::Serializer>(d: &DataType, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(d.name())
}

fn op_name<S: serde::Serializer>(o: &Option<ReduceOp>, s: S) -> Result<S::Ok, S::Error> {
    match o {
        Some(o) => s.serialize_str(o.name()),
        None => s.serialize_none(),
    }
}

pub fn header(out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(out, "#")?;
    writeln!(
        out,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:^34}  {:^34}",
        "", "", "", "", "out-of-place", "in-place"
    )?;
    writeln!(
        out,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>10} {:>7} {:>7} {:>6}  {:>10} {:>7} {:>7} {:>6}",
        "size",
        "count",
        "type",
        "redop",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "time",
        "algbw",
        "busbw",
        "#wrong"
    )?;
    writeln!(
        out,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>10} {:>7} {:>7} {:>6}  {:>10} {:>7} {:>7} {:>6}",
        "(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", ""
    )
}

pub fn row(out: &mut dyn Write, r: &Row) -> std::io::Result<()> {
    let m = |m: &Mode| {
        format!(
            "{:>10.2} {:>7.2} {:>7.2} {:>6}",
            m.time_us, m.algbw_gbs, m.busbw_gbs, m.wrong
        )
    };
    writeln!(
        out,
        "  {:>10}  {:>12}  {:>8}  {:>6}  {}  {}",
        r.bytes,
        r.count,
        r.dtype.name(),
        r.op.map_or("none", |o| o.name()),
        m(&r.out_of_place),
        r.in_place
            .as_ref()
            .map_or_else(|| format!("{:>10} {:>7} {:>7} {:>6}", "n/a", "", "", ""), m)
    )
}

/// Totals printed under the table and stored in the JSON.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub wrong: u64,
    pub avg_busbw_gbs: f64,
    #[serde(flatten)]
    pub most: Maxima,
    /// Whether connections were made at init (`COLL_CONNECT=eager`).
    pub eager_connect: bool,
}

/// What every rank reports, the largest over ranks (one reduction).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Maxima {
    pub peak_rss_bytes_max: u64,
    /// The slowest rank's seconds to form the communicator.
    pub init_seconds_max: f64,
    /// Connections (each lane of a pair counts) the busiest rank held,
    /// and the longest any rank spent making its connections.
    pub connections_max: u64,
    pub connect_seconds_max: f64,
}

impl Summary {
    pub fn of(rows: &[Row], most: Maxima, eager_connect: bool) -> Self {
        let modes: Vec<&Mode> = rows
            .iter()
            .flat_map(|r| [Some(&r.out_of_place), r.in_place.as_ref()])
            .flatten()
            .collect();
        Summary {
            wrong: modes.iter().map(|m| m.wrong).sum(),
            avg_busbw_gbs: if modes.is_empty() {
                0.0
            } else {
                modes.iter().map(|m| m.busbw_gbs).sum::<f64>() / modes.len() as f64
            },
            most,
            eager_connect,
        }
    }
}

pub fn footer(out: &mut dyn Write, s: &Summary, buffers: u64) -> std::io::Result<()> {
    let verdict = if s.wrong == 0 { "OK" } else { "FAILED" };
    writeln!(out, "# Out of bounds values : {} {verdict}", s.wrong)?;
    writeln!(out, "# Avg bus bandwidth    : {:.4}", s.avg_busbw_gbs)?;
    writeln!(
        out,
        "# Peak memory per rank : {} (largest rank's VmHWM; its two buffers are {} each)",
        human_bytes(s.most.peak_rss_bytes_max),
        human_bytes(buffers)
    )?;
    let when = match s.eager_connect {
        true => "at start-up, COLL_CONNECT=eager",
        false => "by the first calls to need them",
    };
    writeln!(
        out,
        "# Start-up             : {:.3} s to form the communicator (slowest rank); {} connections \
         per rank at most, made in {:.3} s ({when})",
        s.most.init_seconds_max, s.most.connections_max, s.most.connect_seconds_max
    )?;
    writeln!(out, "#")
}

/// The whole run, as `--json` writes it.
#[derive(Serialize)]
pub struct Document<'a> {
    pub collective: &'a str,
    pub nranks: usize,
    pub launcher: &'a str,
    pub transport: &'a str,
    pub algorithm: &'a str,
    pub chunk_bytes: usize,
    pub depth: usize,
    pub check: bool,
    /// Buffers allocated as `SharedBuffer`s (`--shared-buffers`).
    pub shared_buffers: bool,
    pub rows: &'a [Row],
    pub summary: &'a Summary,
    /// Rank 0's counters (bytes and messages per peer, calls, waiting).
    pub stats: collectives::Stats,
}

/// `1 GiB`, `256 MiB`, `8 B`.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
