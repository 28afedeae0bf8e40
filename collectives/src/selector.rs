//! Which algorithm runs a call: forced by configuration, predicted fastest
//! by the measured profile, or the built-in thresholds' pick; remembered per
//! (collective, size), since calls repeat their sizes and a choice costs
//! microseconds.

use std::sync::Arc;

use transport::Rank;

use crate::algo::{self, Algorithm};
use crate::tuning::{Profile, Setting};
use crate::{Collective, Config, Error, Result};

/// How much faster the profile must predict another algorithm to be than the
/// built-in choice to take its place.
const PROFILE_MARGIN: f64 = 1.10;

/// One communicator's algorithm choices.
pub(crate) struct Selector {
    rank: Rank,
    size: usize,
    hosts: Vec<Vec<Rank>>,
    setting: Setting,
    /// Measured algorithm costs: the profile's lines for this setting (may be none).
    profile: Profile,
    /// Past choices by (collective, bytes), and why.
    choices: Vec<(Collective, usize, &'static Algorithm, Arc<str>)>,
    /// (collective, algorithm) pairs whose choice has been logged.
    announced: Vec<(Collective, &'static str)>,
}

impl Selector {
    pub fn new(rank: Rank, hosts: Vec<Vec<Rank>>, setting: Setting) -> Self {
        let profile = load_profile(rank).only(&setting);
        Selector {
            rank,
            size: setting.ranks,
            hosts,
            setting,
            profile,
            choices: Vec::new(),
            announced: Vec::new(),
        }
    }

    pub fn setting(&self) -> &Setting {
        &self.setting
    }

    /// Forgets past choices (after the configuration changed).
    pub fn forget(&mut self) {
        self.choices.clear();
    }

    /// [`choose`](Self::choose), remembered, and logged the first time an
    /// algorithm runs a collective.
    pub fn choose_cached(
        &mut self,
        config: &Config,
        collective: Collective,
        bytes: usize,
    ) -> Result<&'static Algorithm> {
        let seen = (self.choices.iter()).find(|c| c.0 == collective && c.1 == bytes);
        if let Some((_, _, algo, _)) = seen {
            return Ok(algo);
        }
        let (algo, why) = self.choose(config, collective, bytes)?;
        if self.choices.len() == 256 {
            self.choices.clear();
        }
        let why: Arc<str> = why.into();
        self.announce(config, collective, algo, &why);
        self.choices.push((collective, bytes, algo, why));
        Ok(algo)
    }

    /// The algorithm for a call, and why.
    pub fn choose(
        &self,
        config: &Config,
        collective: Collective,
        bytes: usize,
    ) -> Result<(&'static Algorithm, String)> {
        if let Some(name) = config.forced_algo(collective) {
            return algo::find(collective, name)
                .map(|a| (a, "forced by COLL_ALGO or --algo".to_string()))
                .ok_or_else(|| Error::InvalidArgument {
                    rank: self.rank,
                    message: format!(
                        "no {collective} algorithm named '{name}' (available: {})",
                        algo::names(collective).join(", ")
                    ),
                });
        }
        let (built_in, why) = algo::select(collective, bytes, self.size, &self.hosts);
        let setting = &self.setting;
        let Some((best, us)) = self.profile.best(collective, setting, bytes) else {
            return Ok((built_in, why.to_string()));
        };
        // The profile overrides the built-in choice only for a predicted gain
        // above measurement noise (one tuning run on a busy host is not exact).
        let built_in_us = (self.profile)
            .predict(collective, built_in.name, setting, bytes)
            .unwrap_or(f64::INFINITY);
        match algo::find(collective, &best.algo) {
            Some(a) if us * PROFILE_MARGIN < built_in_us => Ok((
                a,
                format!(
                    "fastest in the measured profile: {us:.1} us predicted at {bytes} B, {} {built_in_us:.1} us",
                    built_in.name
                ),
            )),
            _ => Ok((
                built_in,
                format!("{why} (the measured profile agrees within {:.0}%)", (PROFILE_MARGIN - 1.0) * 100.0),
            )),
        }
    }

    fn announce(
        &mut self,
        config: &Config,
        collective: Collective,
        algo: &'static Algorithm,
        why: &str,
    ) {
        if self.announced.contains(&(collective, algo.name)) {
            return;
        }
        self.announced.push((collective, algo.name));
        tracing::info!(
            rank = self.rank,
            chunk = config.chunk_bytes,
            depth = config.depth,
            "{collective}: algorithm {}, {why}",
            algo.name
        );
    }
}

/// The selector's profile; a broken one is reported and left out (a
/// missing or stale profile only costs speed).
fn load_profile(rank: Rank) -> Profile {
    match Profile::from_env() {
        Ok(p) => {
            if let Some(src) = &p.source {
                tracing::info!(
                    rank,
                    entries = p.entries.len(),
                    "selector profile {}",
                    src.display()
                );
            }
            p
        }
        Err(e) => {
            tracing::warn!(rank, "{e}; the selector uses its built-in thresholds");
            Profile::default()
        }
    }
}
