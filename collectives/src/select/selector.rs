//! Which algorithm runs a call: forced by configuration, predicted fastest
//! by the measured profile, or (without one) the built-in thresholds' pick,
//! which from [`algo::SCALE_MIN_RANKS`] ranks on asks the simulator;
//! remembered per (collective, size), since calls repeat their sizes and a
//! choice costs microseconds (a simulated one up to a second, once per
//! power-of-two size).

use std::sync::{Arc, Mutex};

use transport::Rank;

use crate::algo::{self, Algorithm, Topology};
use crate::select::tuning::{Profile, Setting};
use crate::simulate::{self, Cluster, Pipeline};
use crate::{Collective, Config, Error, Result};

/// How much faster the profile must predict another algorithm to be than the
/// built-in choice to take its place.
const PROFILE_MARGIN: f64 = 1.10;

/// The algorithm forced for `collective` by `COLL_ALGO` (or `--algo`), if
/// any. A bare name (`ring`) applies to the collectives that have an
/// algorithm of that name; `allreduce=ring` to that collective only,
/// where an unknown name is an error when the collective runs.
pub fn forced_algo(config: &Config, collective: Collective) -> Option<&str> {
    config
        .algo
        .iter()
        .rev()
        .find(|(c, a)| c == collective.name() || (c == "*" && algo::find(collective, a).is_some()))
        .map(|(_, a)| a.as_str())
}

/// One communicator's algorithm choices.
pub(crate) struct Selector {
    rank: Rank,
    size: usize,
    topology: Topology,
    setting: Setting,
    /// Measured algorithm costs: the profile's lines for this setting (may be none).
    profile: Profile,
    /// Past choices by (collective, bytes), and why.
    choices: Vec<(Collective, usize, &'static Algorithm, Arc<str>)>,
    /// (collective, algorithm) pairs whose choice has been logged.
    announced: Vec<(Collective, &'static str)>,
    /// Choices without a profile, and why.
    unprofiled: Mutex<Vec<(Unprofiled, &'static Algorithm, Arc<str>)>>,
}

/// A choice without a profile holds for a collective, a size rounded up to a
/// power of two, and a pipeline.
type Unprofiled = (Collective, usize, Pipeline);

impl Selector {
    pub fn new(rank: Rank, topology: Topology, setting: Setting) -> Self {
        let profile = load_profile(rank).only(&setting);
        Selector {
            rank,
            size: setting.ranks,
            topology,
            setting,
            profile,
            choices: Vec::new(),
            announced: Vec::new(),
            unprofiled: Mutex::default(),
        }
    }

    pub fn setting(&self) -> &Setting {
        &self.setting
    }

    /// Whether every message goes through shared memory.
    pub fn shared_memory(&self) -> bool {
        self.topology.shared_memory
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
        if let Some(name) = forced_algo(config, collective) {
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
        let setting = &self.setting;
        let Some((best, us)) = self.profile.best(collective, setting, bytes) else {
            let (algo, why) = self.unprofiled(config, collective, bytes);
            return Ok((algo, why.to_string()));
        };
        let (built_in, why) = algo::select(collective, bytes, &self.topology);
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

    /// The choice without a profile: the built-in thresholds, or on many
    /// ranks numbered host by host (as the simulator numbers them) and not
    /// crowded onto sockets the simulator's
    /// ([`simulate::unprofiled_choice`]), once per power of two.
    fn unprofiled(
        &self,
        config: &Config,
        collective: Collective,
        bytes: usize,
    ) -> (&'static Algorithm, Arc<str>) {
        let (n, per_host) = (self.size, self.setting.per_host);
        if n < algo::SCALE_MIN_RANKS
            || self.topology.crowded_sockets
            || Cluster::roce(n, per_host).host_ranks() != self.topology.hosts
        {
            let (algo, why) = algo::select(collective, bytes, &self.topology);
            return (algo, why.into());
        }
        let pipeline = Pipeline {
            chunk: config.chunk_bytes,
            depth: config.depth,
        };
        let key = (collective, bytes.next_power_of_two(), pipeline);
        let mut memo = self.unprofiled.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = memo.iter().find(|m| m.0 == key) {
            return (m.1, m.2.clone());
        }
        let rendezvous = !self.setting.transport.contains("tcp");
        let (algo, why) =
            simulate::unprofiled_choice(n, per_host, rendezvous, collective, bytes, pipeline);
        let why: Arc<str> = why.into();
        memo.push((key, algo, why.clone()));
        (algo, why)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algo_overrides() {
        let c = Config {
            algo: crate::parse_algo("ring, alltoall=pairwise"),
            ..Config::default()
        };
        assert_eq!(forced_algo(&c, Collective::AllReduce), Some("ring"));
        assert_eq!(forced_algo(&c, Collective::AllToAll), Some("pairwise"));
        let barrier = forced_algo(&c, Collective::Barrier);
        assert_eq!(barrier, None, "no barrier is called ring");
    }
}
