//! The selector's cost model: a call of S bytes by algorithm a takes
//! `alpha_a + S / beta_a`, a latency (the algorithm's steps, each a message
//! and a wake-up) plus the size over an effective bandwidth. Caches, chunking
//! and scheduling make both change with size, so the constants hold for a
//! range of sizes: one pair per interval between measured sizes (the model
//! then goes through every measurement). They are measured on the running
//! machine by `collbench tune`, per algorithm, rank count, ranks per host and
//! transport, and kept in a profile file that every
//! communicator reads at start (`COLL_PROFILE`, else
//! `~/.cache/collectives/profile.tsv` if it exists). Where the profile has no
//! line for a configuration, the selector falls back to thresholds measured
//! on the development machine (see `algo::select`).
//!
//! The file is plain text, one configuration and algorithm per line:
//!
//! ```text
//! # collective algorithm ranks per_host transport up_to_bytes alpha_us beta_GBps
//! allreduce ring 8 8 shm 1048576 41.2 1.08
//! allreduce ring 8 8 shm inf 120.5 1.12
//! ```

use std::path::{Path, PathBuf};

use crate::Collective;

/// What a profile line applies to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    pub ranks: usize,
    /// The most ranks any host has.
    pub per_host: usize,
    /// The communicator's transports, as `transport_summary` names them (`shm`, `tcp+shm`).
    pub transport: String,
}

/// One measured algorithm in one setting.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub collective: Collective,
    pub algo: String,
    pub setting: Setting,
    /// The largest size these constants hold for (`usize::MAX`: any above
    /// the previous entry's).
    pub up_to: usize,
    /// Fixed cost per call, microseconds.
    pub alpha_us: f64,
    /// Effective bandwidth, GB/s (1e9 bytes per second).
    pub beta_gbps: f64,
}

impl Entry {
    /// The predicted time of a call of `bytes`, microseconds.
    pub fn predict_us(&self, bytes: usize) -> f64 {
        self.alpha_us + bytes as f64 / (self.beta_gbps * 1e3)
    }
}

/// Measured constants, as read from a profile file.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    pub entries: Vec<Entry>,
    /// Where it was read from (for logs).
    pub source: Option<PathBuf>,
}

impl Profile {
    /// `COLL_PROFILE` if set (an unreadable file is an error), else the
    /// default path if it exists, else an empty profile.
    pub fn from_env() -> Result<Self, String> {
        if let Some(p) = std::env::var_os("COLL_PROFILE").filter(|p| !p.is_empty()) {
            return Self::load(Path::new(&p));
        }
        match default_path() {
            Some(p) if p.exists() => Self::load(&p),
            _ => Ok(Profile::default()),
        }
    }

    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the profile {}: {e}", path.display()))?;
        let mut p = Self::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        p.source = Some(path.to_path_buf());
        Ok(p)
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        let mut entries = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            entries.push(parse_line(line).map_err(|e| format!("line {}: {e}", n + 1))?);
        }
        Ok(Profile {
            entries,
            source: None,
        })
    }

    /// The profile as text, in the format [`parse`](Self::parse) reads.
    pub fn render(&self) -> String {
        let mut out = String::from(
            "# collectives tuning profile (collbench tune): a call of S bytes is predicted\n\
             # to take alpha_us + S / beta_GBps; the selector picks the fastest prediction.\n\
             # collective algorithm ranks per_host transport up_to_bytes alpha_us beta_GBps\n",
        );
        for e in &self.entries {
            let up_to = match e.up_to {
                usize::MAX => "inf".to_string(),
                b => b.to_string(),
            };
            out += &format!(
                "{} {} {} {} {} {up_to} {:.3} {:.4}\n",
                e.collective,
                e.algo,
                e.setting.ranks,
                e.setting.per_host,
                e.setting.transport,
                e.alpha_us,
                e.beta_gbps
            );
        }
        out
    }

    /// Only the entries of `setting`.
    pub fn only(mut self, setting: &Setting) -> Self {
        self.entries.retain(|e| e.setting == *setting);
        self
    }

    /// Replaces the entries of `setting` (for `collective`) with `new`.
    pub fn merge(&mut self, collective: Collective, setting: &Setting, new: Vec<Entry>) {
        self.entries
            .retain(|e| !(e.collective == collective && e.setting == *setting));
        self.entries.extend(new);
    }

    /// The algorithm with the smallest predicted time for `bytes`, among
    /// those measured in `setting`, with its prediction.
    pub fn best(
        &self,
        collective: Collective,
        setting: &Setting,
        bytes: usize,
    ) -> Option<(&Entry, f64)> {
        self.entries
            .iter()
            .filter(|e| e.collective == collective && e.setting == *setting)
            .filter(|e| {
                std::ptr::eq(
                    *e,
                    self.entry(collective, &e.algo, setting, bytes).unwrap_or(e),
                )
            })
            .filter(|e| e.up_to >= bytes)
            .map(|e| (e, e.predict_us(bytes)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
    }

    /// The predicted time of `algo` for `bytes` in `setting`, if measured.
    pub fn predict(
        &self,
        collective: Collective,
        algo: &str,
        setting: &Setting,
        bytes: usize,
    ) -> Option<f64> {
        self.entry(collective, algo, setting, bytes)
            .map(|e| e.predict_us(bytes))
    }

    /// The entry of `algo` in `setting` whose size range holds `bytes`.
    fn entry(
        &self,
        collective: Collective,
        algo: &str,
        setting: &Setting,
        bytes: usize,
    ) -> Option<&Entry> {
        self.entries
            .iter()
            .filter(|e| e.collective == collective && e.algo == algo && e.setting == *setting)
            .filter(|e| e.up_to >= bytes)
            .min_by_key(|e| e.up_to)
    }
}

/// `~/.cache/collectives/profile.tsv` (or under `XDG_CACHE_HOME`).
pub fn default_path() -> Option<PathBuf> {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(cache.join("collectives").join("profile.tsv"))
}

fn parse_line(line: &str) -> Result<Entry, String> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let [c, algo, ranks, per_host, transport, up_to, alpha, beta] = f[..] else {
        return Err(format!("expected 8 fields, found {}", f.len()));
    };
    let num = |s: &str, what: &str| -> Result<f64, String> {
        s.parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| format!("{what} '{s}' is not a non-negative number"))
    };
    let collective = Collective::ALL
        .into_iter()
        .find(|k| k.name() == c)
        .ok_or_else(|| format!("unknown collective '{c}'"))?;
    let beta_gbps = num(beta, "beta_GBps")?;
    if beta_gbps == 0.0 {
        return Err("beta_GBps is 0".into());
    }
    Ok(Entry {
        collective,
        algo: algo.to_string(),
        setting: Setting {
            ranks: num(ranks, "ranks")? as usize,
            per_host: num(per_host, "per_host")? as usize,
            transport: transport.to_string(),
        },
        up_to: match up_to {
            "inf" => usize::MAX,
            b => num(b, "up_to_bytes")? as usize,
        },
        alpha_us: num(alpha, "alpha_us")?,
        beta_gbps,
    })
}

/// The model through measurements `(bytes, t_us)`, ascending by size: one
/// `(up_to, alpha_us, beta_GBps)` per interval between neighbours, the line
/// through both (a time that falls with size is held flat: noise, not speed).
/// The first interval also holds smaller sizes, the last larger ones.
pub fn fit(points: &[(usize, f64)]) -> Vec<(usize, f64, f64)> {
    let line = |(b0, t0): (usize, f64), (b1, t1): (usize, f64)| {
        // Microseconds per byte, at least what the larger point alone implies.
        let slope = ((t1 - t0) / (b1 as f64 - b0 as f64)).max(1e-9);
        let alpha = (t0 - b0 as f64 * slope).max(0.0);
        (alpha, 1.0 / slope / 1e3)
    };
    match points {
        [] => Vec::new(),
        [(_, t)] => vec![(usize::MAX, *t, 1e6)],
        _ => points
            .windows(2)
            .enumerate()
            .map(|(i, w)| {
                let (alpha, beta) = line(w[0], w[1]);
                let last = i == points.len() - 2;
                (if last { usize::MAX } else { w[1].0 }, alpha, beta)
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_round_trips_and_predicts() {
        let p = Profile::parse(
            "# comment\nallreduce ring 8 8 shm inf 40 1.5\nallreduce tree 8 8 shm 1000 20 1.0\nallreduce tree 8 8 shm inf 20 1.0\n",
        )
        .unwrap();
        assert_eq!(Profile::parse(&p.render()).unwrap().entries, p.entries);
        let s = Setting {
            ranks: 8,
            per_host: 8,
            transport: "shm".into(),
        };
        assert_eq!(p.best(Collective::AllReduce, &s, 8).unwrap().0.algo, "tree");
        assert_eq!(
            p.best(Collective::AllReduce, &s, 64 << 20).unwrap().0.algo,
            "ring"
        );
        let other = Setting { ranks: 4, ..s };
        assert!(p.best(Collective::AllReduce, &other, 8).is_none());
        assert!(Profile::parse("allreduce ring 8 8 shm inf x 1").is_err());
        assert!(Profile::parse("allreduce ring 8").is_err());
    }

    #[test]
    fn the_model_goes_through_every_measurement() {
        // 10 us + 2 GB/s up to 32 KiB, then 4 GB/s.
        let t = |b: usize| match b <= 1 << 15 {
            true => 10.0 + b as f64 / 2e3,
            false => 10.0 + (1 << 15) as f64 / 2e3 + (b - (1 << 15)) as f64 / 4e3,
        };
        let pts: Vec<(usize, f64)> = [8usize, 1 << 10, 1 << 15, 1 << 20, 1 << 24]
            .iter()
            .map(|&b| (b, t(b)))
            .collect();
        let segs = fit(&pts);
        assert_eq!(segs.len(), 4);
        assert!((segs[0].1 - 10.0).abs() < 1e-6 && (segs[0].2 - 2.0).abs() < 1e-6);
        assert!((segs[3].2 - 4.0).abs() < 1e-6 && segs[3].0 == usize::MAX);
        for (i, &(b, tb)) in pts.iter().enumerate().skip(1) {
            let (_, a, beta) = segs[i - 1];
            assert!((a + b as f64 / (beta * 1e3) - tb).abs() < 1e-6);
        }
    }
}
