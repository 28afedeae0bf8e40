//! The subcommands that are not a benchmark sweep: `simulate` (predicted
//! times from the library's simulator; `control` for forming a job and
//! agreeing), `tune` (measure and write the
//! selector's profile) and `trace` (merge flight records and name the rank
//! at fault). `plot` is with the report it draws (`report/plot.rs`).

pub(crate) mod control;
pub(crate) mod simulate;
pub(crate) mod trace;
pub(crate) mod tune;
