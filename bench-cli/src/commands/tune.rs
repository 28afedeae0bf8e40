//! `collbench tune`: measures every algorithm of the collectives that have a
//! choice, over a size grid, in this job's setting (rank count, ranks per
//! host, transport); fits each to `alpha + size / beta`; and writes the
//! constants to the profile file the library's selector reads.

use std::io::Write;
use std::path::PathBuf;

use collectives::bootstrap::Bootstrap;
use collectives::select::tuning::{self, Entry, Profile};
use collectives::{algo, Collective, Communicator};

use crate::cli::{BenchArgs, TuneArgs};
use crate::report::human_bytes;
use crate::sweep::bench::{self, Bench};

/// The collectives with more than one algorithm, in `ALGORITHMS` order.
pub fn tunable() -> Vec<Collective> {
    Collective::ALL
        .into_iter()
        .filter(|c| algo::names(*c).len() > 1)
        .collect()
}

/// Measures, fits and (rank 0) writes the profile. Returns the report.
pub fn run(
    comm: &mut Communicator,
    args: &BenchArgs,
    sizes: &[u64],
    out: Option<PathBuf>,
) -> Result<(), String> {
    let e = |e: collectives::Error| e.to_string();
    let setting = comm.setting();
    let rank0 = comm.rank() == 0;
    let path = out
        .or_else(tuning::default_path)
        .ok_or("no --out and no HOME to put the profile under")?;
    let mut profile = match path.exists() {
        true => Profile::load(&path)?,
        false => Profile::default(),
    };
    let max = *sizes.iter().max().expect("at least one size");
    bench::settle(comm, args.settle).map_err(e)?;
    let quiet = BenchArgs {
        check: 0,
        ..args.clone()
    };
    let mut stdout = std::io::stdout();
    if rank0 {
        println!(
            "# collbench tune: {} ranks, {} per host, transport {}; sizes {}",
            setting.ranks,
            setting.per_host,
            setting.transport,
            sizes
                .iter()
                .map(|s| human_bytes(*s))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let header: Vec<String> = sizes
            .iter()
            .map(|s| format!("{:>10}", human_bytes(*s)))
            .collect();
        println!("# median time (us) of {REPETITIONS} interleaved runs, out of and in place");
        println!("# collective    algorithm     {}", header.join(" "));
    }
    let hosts = comm.hosts();
    for collective in tunable() {
        let names: Vec<&str> = algo::names(collective)
            .into_iter()
            .filter(|n| algo::fits(n, &hosts))
            .collect();
        // Repetitions interleaved across algorithms, so that a noisy moment
        // of the machine does not pick the winner; the median counts.
        let mut samples = vec![vec![Vec::new(); sizes.len()]; names.len()];
        for _ in 0..REPETITIONS {
            for (a, name) in names.iter().enumerate() {
                comm.force_algo(collective, Some(name));
                let mut bench = Bench::new(comm, &quiet, collective, max)?;
                for (i, &size) in sizes.iter().enumerate() {
                    let row = bench.row(size).map_err(e)?;
                    for mode in [Some(row.out_of_place), row.in_place].into_iter().flatten() {
                        samples[a][i].push((row.bytes as usize, mode.time_us));
                    }
                }
            }
        }
        comm.force_algo(collective, None);
        let mut entries = Vec::new();
        for (a, name) in names.iter().enumerate() {
            let points: Vec<(usize, f64)> = samples[a].iter_mut().map(|s| median(s)).collect();
            if rank0 {
                let times: Vec<String> = points.iter().map(|(_, t)| format!("{t:10.1}")).collect();
                println!(
                    "  {:<13} {:<13} {}",
                    collective.name(),
                    name,
                    times.join(" ")
                );
                stdout.flush().ok();
            }
            entries.extend(
                tuning::fit(&points)
                    .into_iter()
                    .map(|(up_to, alpha_us, beta_gbps)| Entry {
                        collective,
                        algo: name.to_string(),
                        setting: setting.clone(),
                        up_to,
                        alpha_us,
                        beta_gbps,
                    }),
            );
        }
        profile.merge(collective, &setting, entries);
    }
    if rank0 {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        std::fs::write(&path, profile.render())
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        println!(
            "# profile written to {} (the selector reads it at start; COLL_PROFILE names another)",
            path.display()
        );
    }
    Ok(())
}

/// Timed runs of every algorithm at every size (each out of place and in place).
const REPETITIONS: usize = 3;

/// The median `(bytes, time)` of one algorithm's samples at one size.
fn median(samples: &mut [(usize, f64)]) -> (usize, f64) {
    samples.sort_by(|a, b| a.1.total_cmp(&b.1));
    samples[samples.len() / 2]
}

/// This process is one rank of `collbench tune`.
pub(crate) fn run_rank(t: &TuneArgs) -> Result<(), String> {
    let sizes = t.sizes.clone().unwrap_or_else(|| {
        ["8", "1K", "32K", "256K", "1M", "4M", "16M"]
            .iter()
            .map(|s| collectives::parse_size(s).expect("valid"))
            .collect()
    });
    let boot = Bootstrap::from_env()?;
    // The algorithms are forced one by one; the profile must not decide.
    let mut comm = Communicator::init(
        boot,
        crate::settings::config(Collective::Barrier, &t.bench)?,
    )
    .map_err(|e| e.to_string())?;
    run(&mut comm, &t.bench, &sizes, t.out.clone())
}
