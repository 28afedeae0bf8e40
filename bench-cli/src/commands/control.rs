//! `collbench simulate init|agree|shrink`: the control plane's predicted
//! rounds, messages and time at a job size, from the library's model
//! (`collectives::simulate::control`).

use std::io::Write;

use collectives::simulate::control::{self, ControlPrediction};
use collectives::simulate::Cluster;
use serde::Serialize;

use crate::report;

#[derive(Serialize)]
struct PhaseRow {
    phase: &'static str,
    ends_s: f64,
    messages: u64,
    busiest_rank_bytes: f64,
}

#[derive(Serialize)]
struct Report {
    predicts: String,
    ranks: usize,
    rounds: usize,
    seconds: f64,
    messages: u64,
    entry_bytes: f64,
    phases: Vec<PhaseRow>,
}

/// Prints `p`, the prediction of `kind` on `cluster`, and writes it as
/// JSON to `json` (`-`: standard output) if asked.
pub fn report(
    kind: &str,
    cluster: &Cluster,
    p: &ControlPrediction,
    json: Option<&std::path::Path>,
) -> Result<(), String> {
    let mut out = report::table_out(json);
    print(&mut out, kind, cluster, p).map_err(|e| e.to_string())?;
    let Some(path) = json else {
        return Ok(());
    };
    let doc = Report {
        predicts: kind.to_string(),
        ranks: p.ranks,
        rounds: p.rounds,
        seconds: p.seconds(),
        messages: p.messages(),
        entry_bytes: control::entry_bytes(),
        phases: (p.phases.iter())
            .map(|ph| PhaseRow {
                phase: ph.name,
                ends_s: ph.seconds,
                messages: ph.messages,
                busiest_rank_bytes: ph.busiest_bytes,
            })
            .collect(),
    };
    report::write_json(path, &doc)
}

fn print(
    out: &mut dyn Write,
    kind: &str,
    cluster: &Cluster,
    p: &ControlPrediction,
) -> std::io::Result<()> {
    writeln!(
        out,
        "# collbench simulate: {kind} of {} ranks on {cluster}",
        p.ranks
    )?;
    writeln!(
        out,
        "# {:<40} {:>12} {:>12} {:>14}",
        "phase", "ends (ms)", "messages", "busiest (MB)"
    )?;
    for ph in &p.phases {
        writeln!(
            out,
            "  {:<40} {:>12.2} {:>12} {:>14.2}",
            ph.name,
            ph.seconds * 1e3,
            ph.messages,
            ph.busiest_bytes / 1e6
        )?;
    }
    writeln!(
        out,
        "# in all: {:.2} ms, {} messages, {} rounds one after another",
        p.seconds() * 1e3,
        p.messages(),
        p.rounds
    )
}
