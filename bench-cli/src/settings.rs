//! The library's settings for a collbench run: the environment first
//! (`COLL_*`), collbench's flags over it, checked before any rank starts.

use std::time::Duration;

use collectives::{Collective, Config};

use crate::cli::BenchArgs;

/// collbench's own default timeout; the library's (300 s) suits training jobs
/// whose ranks may be busy elsewhere, a benchmark should fail faster.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

pub(crate) fn timeout(args: &BenchArgs) -> Result<Duration, String> {
    Ok(match args.timeout {
        Some(t) => t,
        None if std::env::var("COLL_TIMEOUT").is_ok() => Config::from_env()?.timeout,
        None => DEFAULT_TIMEOUT,
    })
}

/// The arguments the library would otherwise refuse only in every rank.
pub(crate) fn check_args(collective: Collective, args: &BenchArgs, n: usize) -> Result<(), String> {
    args.sizes()?;
    if let Some(name) = &args.algo {
        if collectives::algo::find(collective, &name.to_lowercase()).is_none() {
            return Err(format!(
                "no {collective} algorithm named '{name}' (available: {})",
                collectives::algo::names(collective).join(", ")
            ));
        }
    }
    if collective.rooted() && args.root >= n {
        return Err(format!(
            "{collective}: root {} is not a rank of the {n}",
            args.root
        ));
    }
    Ok(())
}

/// The library settings: environment first, flags over it.
pub(crate) fn config(collective: Collective, args: &BenchArgs) -> Result<Config, String> {
    let mut c = Config::from_env()?;
    c.timeout = timeout(args)?;
    if let Some(t) = &args.transport {
        c.transport = t.clone();
    }
    if let Some(a) = &args.algo {
        // --algo names the benchmarked collective's algorithm only.
        c.algo
            .push((collective.name().to_string(), a.to_lowercase()));
    }
    if let Some(chunk) = args.chunk {
        c.chunk_bytes = chunk as usize;
    }
    if let Some(d) = args.depth {
        c.depth = d;
    }
    c.validate()?;
    Ok(c)
}
