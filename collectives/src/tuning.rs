//! The selector's cost model: a call of S bytes by algorithm a takes
//! `alpha_a + S / beta_a`, a latency (the algorithm's steps, each a message
//! and a wake-up) plus the size over an effective bandwidth. The constants are
//! measured on the running machine by `collbench tune`, per algorithm, rank
//! count, ranks per host and transport, and kept in a profile file that every
//! communicator reads at start (`COLL_PROFILE`, else
//! `~/.cache/collectives/profile.tsv` if it exists). Where the profile has no
//! line for a configuration, the selector falls back to thresholds measured
//! on the development machine (see `algo::select`).
//!
//! The file is plain text, one configuration and algorithm per line:
//!
//! ```text
//! # collective algorithm ranks per_host transport alpha_us beta_GBps
//! allreduce ring 8 8 shm 41.2 1.08
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
             # collective algorithm ranks per_host transport alpha_us beta_GBps\n",
        );
        for e in &self.entries {
            out += &format!(
                "{} {} {} {} {} {:.3} {:.4}\n",
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

    /// Replaces the entries of `setting` (for `collective`) with `new`.
    pub fn merge(&mut self, collective: Collective, setting: &Setting, new: Vec<Entry>) {
        self.entries
            .retain(|e| !(e.collective == collective && e.setting == *setting));
        self.entries.extend(new);
    }

    /// The algorithm with the smallest predicted time for `bytes`, among
    /// those measured in `setting`, with its prediction.
    pub fn best(&self, collective: Collective, setting: &Setting, bytes: usize) -> Option<(&Entry, f64)> {
        self.entries
            .iter()
            .filter(|e| e.collective == collective && e.setting == *setting)
            .map(|e| (e, e.predict_us(bytes)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
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
    let [c, algo, ranks, per_host, transport, alpha, beta] = f[..] else {
        return Err(format!("expected 7 fields, found {}", f.len()));
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
        alpha_us: num(alpha, "alpha_us")?,
        beta_gbps,
    })
}

/// Fits `t = alpha + bytes / beta` to measurements `(bytes, t_us)` by least
/// squares on relative error (small sizes count as much as large ones).
/// Returns `(alpha_us, beta_GBps)`.
pub fn fit(points: &[(usize, f64)]) -> (f64, f64) {
    // Minimise sum ((alpha + x * inv - t) / t)^2 over alpha >= 0, inv > 0.
    let (mut saa, mut sax, mut sxx, mut sa, mut sx) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(bytes, t) in points {
        let (x, w) = (bytes as f64, 1.0 / (t * t));
        saa += w;
        sax += w * x;
        sxx += w * x * x;
        sa += w * t;
        sx += w * x * t;
    }
    let det = saa * sxx - sax * sax;
    let (mut alpha, mut inv) = if det.abs() > 0.0 {
        ((sa * sxx - sax * sx) / det, (saa * sx - sax * sa) / det)
    } else {
        (0.0, 0.0)
    };
    if alpha < 0.0 {
        // Latency cannot be negative: the best fit through the origin.
        alpha = 0.0;
        inv = if sxx > 0.0 { sx / sxx } else { 0.0 };
    }
    let inv = inv.max(1e-9);
    // inv is microseconds per byte; 1 / inv bytes per microsecond = MB/s.
    (alpha, 1.0 / inv / 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_round_trips_and_predicts() {
        let p = Profile::parse("# comment\nallreduce ring 8 8 shm 40 1.5\nallreduce tree 8 8 shm 20 1.0\n")
            .unwrap();
        assert_eq!(Profile::parse(&p.render()).unwrap().entries, p.entries);
        let s = Setting {
            ranks: 8,
            per_host: 8,
            transport: "shm".into(),
        };
        assert_eq!(p.best(Collective::AllReduce, &s, 8).unwrap().0.algo, "tree");
        assert_eq!(p.best(Collective::AllReduce, &s, 64 << 20).unwrap().0.algo, "ring");
        let other = Setting { ranks: 4, ..s };
        assert!(p.best(Collective::AllReduce, &other, 8).is_none());
        assert!(Profile::parse("allreduce ring 8 8 shm x 1").is_err());
        assert!(Profile::parse("allreduce ring 8").is_err());
    }

    #[test]
    fn the_fit_recovers_latency_and_bandwidth() {
        // 10 us + 2 GB/s.
        let pts: Vec<(usize, f64)> = [8usize, 1 << 10, 1 << 15, 1 << 20, 1 << 24]
            .iter()
            .map(|&b| (b, 10.0 + b as f64 / 2e3))
            .collect();
        let (a, b) = fit(&pts);
        assert!((a - 10.0).abs() < 1e-6 && (b - 2.0).abs() < 1e-6, "{a} {b}");
    }
}
