//! Logging behind `COLL_DEBUG`, in the spirit of `NCCL_DEBUG`.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs a stderr logger at the level `COLL_DEBUG` names (`WARN` if unset;
/// `INFO` shows transport, algorithm, chunk size and peers; a full
/// `tracing` filter such as `collectives=debug` also works). Does nothing if
/// the application installed its own subscriber.
pub fn init() {
    let level = std::env::var("COLL_DEBUG").unwrap_or_default();
    let directive = match level.trim().to_ascii_lowercase().as_str() {
        "" => "warn".to_string(),
        l @ ("error" | "warn" | "info" | "debug" | "trace") => {
            format!("collectives={l},transport={l}")
        }
        "version" => "warn".to_string(),
        other => other.to_string(),
    };
    let filter = EnvFilter::try_new(&directive).unwrap_or_else(|_| EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .try_init();
}

/// Writes `text` and a newline to stderr in one `write`, so that the lines
/// of ranks sharing a terminal or pipe never interleave mid-line
/// (`eprintln!` may write the text and the newline separately).
pub fn eprint_line(text: &str) {
    use std::io::Write;
    let mut line = String::with_capacity(text.len() + 1);
    line.push_str(text);
    line.push('\n');
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}
