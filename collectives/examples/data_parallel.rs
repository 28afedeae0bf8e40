//! Data-parallel training of a small MLP over 4 ranks, gradients averaged
//! with non-blocking AllReduces, one bucket per layer, started as soon as the
//! backward pass has produced it: the communication of layer l overlaps the
//! backward computation of layers l-1 .. 1.
//!
//!     cargo run --release -p collectives --example data_parallel [-- --ranks 4 --steps 20]
//!
//! It runs the same steps four ways from the same initial weights and data:
//! compute only (no communication: the compute time), communication only
//! (the same AllReduces, no compute: the communication time), without
//! overlap (backward, then all AllReduces) and with overlap. It prints the
//! median time per step of each, and checks that every rank ends with
//! bitwise-identical weights, the same with and without overlap.

use std::time::{Duration, Instant};

use collectives::bootstrap::{launch, under_launcher};
use collectives::{AsyncCommunicator, Communicator, Handle, ReduceOp};

struct Args {
    ranks: usize,
    steps: usize,
    layers: usize,
    hidden: usize,
    batch: usize,
}

fn parse_args() -> Args {
    let mut a = Args {
        ranks: 4,
        steps: 20,
        layers: 6,
        hidden: 1024,
        batch: 8,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let v = || pair.get(1).and_then(|v| v.parse().ok()).expect("a number");
        match pair[0].as_str() {
            "--ranks" => a.ranks = v(),
            "--steps" => a.steps = v(),
            "--layers" => a.layers = v(),
            "--hidden" => a.hidden = v(),
            "--batch" => a.batch = v(),
            other => panic!("unknown flag {other} (--ranks --steps --layers --hidden --batch)"),
        }
    }
    a
}

fn main() {
    let args = parse_args();
    if !under_launcher() {
        let job = launch::Launch {
            nranks: args.ranks,
            program: std::env::current_exe().unwrap(),
            args: std::env::args_os().skip(1).collect(),
            env: Vec::new(),
            timeout: Duration::from_secs(120),
            bind: launch::Bind::from_env().unwrap(),
        };
        let outcome = launch::run(&job).expect("launching the ranks");
        for f in &outcome.failures {
            eprintln!("launcher: {f}");
        }
        std::process::exit(if outcome.success() { 0 } else { 1 });
    }
    if let Err(e) = rank_main(&args) {
        eprintln!("{e}");
        std::process::exit(1);
    }
}

/// How a step treats its gradients.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    ComputeOnly,
    CommOnly,
    Sequential,
    Overlapped,
}

fn rank_main(args: &Args) -> collectives::Result<()> {
    let comm = AsyncCommunicator::new(Communicator::from_env()?);
    let rank = comm.rank();
    let initial = Model::new(args.layers, args.hidden);
    let mut results = Vec::new();
    for mode in [
        Mode::ComputeOnly,
        Mode::CommOnly,
        Mode::Sequential,
        Mode::Overlapped,
    ] {
        let mut model = initial.clone();
        let mut times = Vec::new();
        comm.barrier().wait()?;
        for step in 0..args.steps {
            let t = Instant::now();
            train_step(&comm, &mut model, mode, args.batch, step)?;
            times.push(t.elapsed());
        }
        times.sort();
        results.push((mode, times[times.len() / 2], model));
    }
    let [(_, compute, _), (_, communicate, _), (_, sequential, a), (_, overlapped, b)] =
        <[_; 4]>::try_from(results).ok().unwrap();
    let same_modes = a.bits() == b.bits();
    let h = a.hash();
    let agreed = comm.all_reduce(vec![h, !h], ReduceOp::Max).wait()? == [h, !h];
    if rank == 0 {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "{} ranks, {} layers of {}x{} f32 ({:.1} MiB of gradients), batch {} per rank, median of {} steps:",
            comm.size(),
            args.layers,
            args.hidden,
            args.hidden,
            (args.layers * args.hidden * args.hidden * 4) as f64 / (1 << 20) as f64,
            args.batch,
            args.steps
        );
        println!("  compute only        {:8.2} ms/step", ms(compute));
        println!("  communication only  {:8.2} ms/step", ms(communicate));
        println!("  without overlap     {:8.2} ms/step", ms(sequential));
        println!(
            "  with overlap        {:8.2} ms/step  ({:.2}x the compute + communication sum)",
            ms(overlapped),
            overlapped.as_secs_f64() / (compute + communicate).as_secs_f64()
        );
    }
    println!(
        "rank {rank}: weights bitwise identical on every rank: {agreed}; same with and without overlap: {same_modes}"
    );
    if !(agreed && same_modes) {
        return Err(collectives::Error::InvalidArgument {
            rank,
            message: "the ranks' weights differ".into(),
        });
    }
    Ok(())
}

/// One step: forward, backward with gradient AllReduces as `mode` says, SGD.
fn train_step(
    comm: &AsyncCommunicator,
    model: &mut Model,
    mode: Mode,
    batch: usize,
    step: usize,
) -> collectives::Result<()> {
    let h = model.hidden;
    let (x, target) = data(comm.rank(), step, batch, h);
    let layers = model.weights.len();
    let mut pending: Vec<(usize, Handle<Vec<f32>>)> = Vec::new();
    let mut grads: Vec<Option<Vec<f32>>> = vec![None; layers];
    if mode == Mode::CommOnly {
        for l in (0..layers).rev() {
            pending.push((l, comm.all_reduce(vec![0.5; h * h], ReduceOp::Avg)));
        }
    } else {
        let acts = model.forward(&x, batch);
        // Output error of a squared loss.
        let mut delta: Vec<f32> = acts[layers]
            .iter()
            .zip(&target)
            .map(|(y, t)| y - t)
            .collect();
        for l in (0..layers).rev() {
            let grad = outer(&acts[l], &delta, batch, h);
            if l > 0 {
                delta = model.back(l, &delta, &acts[l], batch);
            }
            match mode {
                Mode::Overlapped => pending.push((l, comm.all_reduce(grad, ReduceOp::Avg))),
                _ => grads[l] = Some(grad),
            }
        }
        if mode == Mode::Sequential {
            for l in (0..layers).rev() {
                let g = grads[l].take().unwrap();
                pending.push((l, comm.all_reduce(g, ReduceOp::Avg)));
            }
        }
    }
    for (l, handle) in pending {
        grads[l] = Some(handle.wait()?);
    }
    if mode != Mode::CommOnly {
        for (w, g) in model.weights.iter_mut().zip(grads) {
            for (w, g) in w.iter_mut().zip(g.unwrap()) {
                *w -= 0.01 * g;
            }
        }
    }
    Ok(())
}

/// Layers of `hidden` x `hidden` weights with ReLU between them.
#[derive(Clone)]
struct Model {
    hidden: usize,
    weights: Vec<Vec<f32>>,
}

impl Model {
    /// The same weights on every rank: a fixed seed.
    fn new(layers: usize, hidden: usize) -> Self {
        let scale = (1.0 / hidden as f32).sqrt();
        let weights = (0..layers)
            .map(|l| noise(l as u64 + 1000, hidden * hidden, scale))
            .collect();
        Model { hidden, weights }
    }

    /// Activations of every layer, the input first.
    fn forward(&self, x: &[f32], batch: usize) -> Vec<Vec<f32>> {
        let mut acts = vec![x.to_vec()];
        for (l, w) in self.weights.iter().enumerate() {
            let mut y = matmul(acts.last().unwrap(), w, batch, self.hidden);
            if l + 1 < self.weights.len() {
                y.iter_mut().for_each(|v| *v = v.max(0.0));
            }
            acts.push(y);
        }
        acts
    }

    /// The error at layer `l`'s input: delta W_l^T, through the ReLU.
    fn back(&self, l: usize, delta: &[f32], input: &[f32], batch: usize) -> Vec<f32> {
        let h = self.hidden;
        let w = &self.weights[l];
        let mut out = vec![0.0; batch * h];
        for b in 0..batch {
            for i in 0..h {
                let row = &w[i * h..(i + 1) * h];
                let d = &delta[b * h..(b + 1) * h];
                let s: f32 = row.iter().zip(d).map(|(w, d)| w * d).sum();
                out[b * h + i] = if input[b * h + i] > 0.0 { s } else { 0.0 };
            }
        }
        out
    }

    fn bits(&self) -> Vec<u32> {
        self.weights.iter().flatten().map(|w| w.to_bits()).collect()
    }

    fn hash(&self) -> u64 {
        self.bits().iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
        })
    }
}

/// `x (batch x h) . w (h x h)`.
fn matmul(x: &[f32], w: &[f32], batch: usize, h: usize) -> Vec<f32> {
    let mut y = vec![0.0; batch * h];
    for b in 0..batch {
        let out = &mut y[b * h..(b + 1) * h];
        for i in 0..h {
            let xi = x[b * h + i];
            for (o, w) in out.iter_mut().zip(&w[i * h..(i + 1) * h]) {
                *o += xi * w;
            }
        }
    }
    y
}

/// The weight gradient `a^T . delta` (h x h), averaged over the batch.
fn outer(a: &[f32], delta: &[f32], batch: usize, h: usize) -> Vec<f32> {
    let mut g = vec![0.0; h * h];
    for b in 0..batch {
        let d = &delta[b * h..(b + 1) * h];
        for i in 0..h {
            let ai = a[b * h + i] / batch as f32;
            for (g, d) in g[i * h..(i + 1) * h].iter_mut().zip(d) {
                *g += ai * d;
            }
        }
    }
    g
}

/// This rank's batch for `step`: inputs and targets.
fn data(rank: usize, step: usize, batch: usize, h: usize) -> (Vec<f32>, Vec<f32>) {
    let seed = (rank as u64) << 32 | step as u64;
    (
        noise(seed, batch * h, 1.0),
        noise(seed ^ 0xdead, batch * h, 0.1),
    )
}

/// Deterministic values in [-scale, scale).
fn noise(seed: u64, len: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}
