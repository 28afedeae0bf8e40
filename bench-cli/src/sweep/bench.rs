//! One rank's part of a benchmark run: the sweep, timing and checking.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use collectives::{
    Buffers, Collective, Communicator, DataType, HugeBuffer, ReduceOp, SharedBuffer,
};

use crate::cli::BenchArgs;
use crate::report::human_bytes;
use crate::report::{Mode, Row};
use crate::sweep::data;
use crate::sweep::skew::Skew;

/// The benchmark state of one rank.
pub struct Bench<'a> {
    pub comm: &'a mut Communicator,
    pub args: &'a BenchArgs,
    pub collective: Collective,
    send: Memory,
    recv: Memory,
    /// AllToAllv's split of the size being measured.
    skew: Option<Skew>,
    started: Instant,
    /// When the last progress line went to a log (not a terminal).
    logged: Instant,
    /// Which size of how many the sweep is at, for the progress bar.
    pub sweep: (usize, usize),
}

/// A benchmark buffer: on huge pages, or a `SharedBuffer` (`--shared-buffers`).
enum Memory {
    Huge(HugeBuffer),
    Shared(SharedBuffer),
}

impl Memory {
    fn new(bytes: usize, shared: bool) -> Result<Self, String> {
        Ok(match shared {
            true => {
                Memory::Shared(SharedBuffer::new(bytes).map_err(|e| {
                    format!("cannot allocate a shared buffer of {bytes} bytes: {e}")
                })?)
            }
            false => Memory::Huge(HugeBuffer::new(bytes)),
        })
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Memory::Huge(b) => b.bytes(),
            Memory::Shared(b) => b.bytes(),
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Memory::Huge(b) => b.bytes_mut(),
            Memory::Shared(b) => b.bytes_mut(),
        }
    }
}

/// Barriers per round of `--settle`, between looks at the clock.
const SETTLE_ROUND: usize = 100;

/// Runs barriers for `ms` milliseconds (every rank goes on while any
/// rank's clock says so): `--settle`, once before a run's first size.
pub fn settle(comm: &mut Communicator, ms: u64) -> Result<(), collectives::Error> {
    let until = Instant::now() + Duration::from_millis(ms);
    let mut more = [u32::from(ms > 0)];
    while more[0] != 0 {
        for _ in 0..SETTLE_ROUND {
            comm.barrier()?;
        }
        more = [u32::from(Instant::now() < until)];
        comm.all_reduce_in_place(&mut more, ReduceOp::Max)?;
    }
    Ok(())
}

impl<'a> Bench<'a> {
    /// Allocates both buffers for the largest size once; every size reuses
    /// them. Fails only where shared buffers (`--shared-buffers`) cannot be
    /// allocated.
    pub fn new(
        comm: &'a mut Communicator,
        args: &'a BenchArgs,
        collective: Collective,
        max_bytes: u64,
    ) -> Result<Self, String> {
        // AllToAllv: a popular destination receives more than it sends.
        let recv_bytes = match collective {
            Collective::AllToAllV => {
                let elem = args.dtype.size();
                let skew = Skew::new(
                    comm.size(),
                    comm.rank(),
                    max_bytes as usize / elem,
                    args.dtype,
                );
                skew.counts().total_received() * elem
            }
            _ => max_bytes as usize,
        };
        let shared = args.shared_buffers();
        Ok(Bench {
            comm,
            args,
            collective,
            send: Memory::new(max_bytes as usize, shared)?,
            recv: Memory::new(recv_bytes, shared)?,
            skew: None,
            started: Instant::now(),
            logged: Instant::now(),
            sweep: (0, 1),
        })
    }

    /// Elements of the (larger) buffer for a requested size: a multiple of
    /// the rank count for the collectives that cut it into blocks.
    pub fn count(&self, bytes: u64) -> usize {
        let count = bytes as usize / self.args.dtype.size();
        match self.blocks() {
            true => count / self.comm.size() * self.comm.size(),
            false => count,
        }
    }

    fn blocks(&self) -> bool {
        matches!(
            self.collective,
            Collective::AllToAll | Collective::ReduceScatter | Collective::AllGather
        )
    }

    /// Measures one size, out of place then in place.
    pub fn row(&mut self, requested: u64) -> Result<Row, collectives::Error> {
        let count = self.count(requested);
        let bytes = count * self.args.dtype.size();
        if self.collective == Collective::AllToAllV {
            let (n, rank) = (self.comm.size(), self.comm.rank());
            self.skew = Some(Skew::new(n, rank, count, self.args.dtype));
        }
        let out_of_place = self.measure(bytes, false)?;
        let in_place = match self.collective {
            Collective::AllToAllV => None,
            _ => Some(self.measure(bytes, true)?),
        };
        Ok(Row {
            bytes: bytes as u64,
            count: count as u64,
            dtype: self.args.dtype,
            op: self.collective.reduces().then_some(self.args.op),
            out_of_place,
            in_place,
        })
    }

    fn measure(&mut self, bytes: usize, in_place: bool) -> Result<Mode, collectives::Error> {
        let (iters, warmup) = self.args.iterations(bytes as u64);
        let wrong = if self.args.check == 1 {
            self.check(bytes, in_place)?
        } else {
            0
        };
        // Worked out once: a call of nothing to move takes 20 ns, and a
        // division a call would be a tenth of it.
        let lens = self.lengths(bytes, in_place);
        let t0 = Instant::now();
        for _ in 0..warmup {
            self.call(lens, in_place)?;
        }
        let mut pace = [t0.elapsed().as_secs_f64() / warmup.max(1) as f64];
        self.comm.all_reduce_in_place(&mut pace, ReduceOp::Max)?;
        let iters = self.args.paced(bytes as u64, iters, pace[0]);
        self.comm.barrier()?;
        let t0 = Instant::now();
        // Progress lines are for calls that take long; reading the clock
        // after every call would add its cost to a small call's time.
        let mut slow = None;
        for i in 0..iters {
            self.call(lens, in_place)?;
            if *slow.get_or_insert_with(|| t0.elapsed() >= Duration::from_millis(1)) {
                self.progress(bytes, in_place, i + 1, iters, t0.elapsed());
            }
        }
        let mut time = [t0.elapsed().as_secs_f64() / iters as f64];
        self.comm.all_reduce_in_place(&mut time, ReduceOp::Max)?;
        let mut wrong = [wrong];
        self.comm.all_reduce_in_place(&mut wrong, ReduceOp::Sum)?;
        Ok(Mode::new(
            bytes as u64,
            time[0],
            self.bus_factor(),
            wrong[0],
        ))
    }

    /// Fills the inputs with this rank's pattern and the output with
    /// another, runs once, counts wrong elements.
    fn check(&mut self, bytes: usize, in_place: bool) -> Result<u64, collectives::Error> {
        let (rank, n, dtype, op) = (
            self.comm.rank(),
            self.comm.size(),
            self.args.dtype,
            self.args.op,
        );
        let (send_len, recv_len) = self.lengths(bytes, in_place);
        let recv = &mut self.recv.bytes_mut()[..recv_len];
        // Whatever the call must overwrite holds values it must not leave.
        data::fill_alltoall(recv, dtype, n + 1);
        let block = bytes / n;
        let input = match in_place {
            true if self.collective == Collective::AllGather => &mut recv[rank * block..][..block],
            true => recv,
            false => &mut self.send.bytes_mut()[..send_len],
        };
        match self.collective {
            Collective::AllToAll | Collective::AllGather | Collective::AllToAllV => {
                data::fill_alltoall(input, dtype, rank)
            }
            Collective::Broadcast if rank == self.args.root => {
                data::fill_alltoall(input, dtype, rank)
            }
            Collective::Broadcast => {}
            _ => data::fill_allreduce(input, dtype, op, rank),
        }
        self.call((send_len, recv_len), in_place)?;
        let result = &self.recv.bytes()[..recv_len];
        let elem = dtype.size();
        Ok(match self.collective {
            Collective::AllToAll => data::check_alltoall(result, dtype, rank, n),
            Collective::AllToAllV => {
                let skew = self.skew.as_ref().expect("set by row");
                let c = skew.counts();
                (0..n)
                    .map(|j| {
                        let block = &result[c.recv_displs[j] * elem..][..c.recv_counts[j] * elem];
                        data::check_copy_of(block, dtype, j, skew.sender_offsets[j])
                    })
                    .sum()
            }
            Collective::AllGather => (0..n)
                .map(|j| data::check_copy_of(&result[j * block..][..block], dtype, j, 0))
                .sum(),
            Collective::ReduceScatter => {
                let mine = if in_place {
                    &result[rank * block..][..block]
                } else {
                    result
                };
                data::check_reduced_from(mine, dtype, op, n, rank * block / elem)
            }
            Collective::Broadcast => data::check_copy_of(result, dtype, self.args.root, 0),
            Collective::Reduce if rank != self.args.root => 0,
            _ => data::check_allreduce(result, dtype, op, n),
        })
    }

    /// Bytes of the send and receive buffers for a call of `bytes` (the
    /// larger buffer), in place or not.
    fn lengths(&self, bytes: usize, in_place: bool) -> (usize, usize) {
        let block = bytes / self.comm.size();
        if let Some(skew) = &self.skew {
            let (c, elem) = (skew.counts(), self.args.dtype.size());
            return (c.total_sent() * elem, c.total_received() * elem);
        }
        match (self.collective, in_place) {
            (_, true) => (0, bytes),
            (Collective::ReduceScatter, false) => (bytes, block),
            (Collective::AllGather, false) => (block, bytes),
            _ => (bytes, bytes),
        }
    }

    /// One call on the first `send_len` and `recv_len` bytes of the buffers.
    fn call(
        &mut self,
        (send_len, recv_len): (usize, usize),
        in_place: bool,
    ) -> Result<(), collectives::Error> {
        let send = &mut self.send.bytes_mut()[..send_len];
        let recv = &mut self.recv.bytes_mut()[..recv_len];
        if self.args.fresh {
            rewrite_lines(if in_place { &mut *recv } else { &mut *send });
        }
        let bufs = if in_place {
            Buffers::InPlace(recv)
        } else {
            Buffers::OutOfPlace { send, recv }
        };
        if let Some(skew) = &self.skew {
            return self.comm.call(&skew.args, bufs);
        }
        let c = self.collective;
        let op = c.reduces().then_some(self.args.op);
        let root = c.rooted().then_some(self.args.root);
        self.comm
            .collective_bytes(c, bufs, self.args.dtype, op, root)
    }

    /// nccl-tests' bus bandwidth factor (AllToAllv: the bytes its busiest
    /// rank sends to others, over the size).
    fn bus_factor(&self) -> f64 {
        match &self.skew {
            Some(skew) => skew.bus_factor,
            None => self.collective.bus_factor(self.comm.size()),
        }
    }

    /// A line on stderr (rank 0) when iterations are slow enough to wonder.
    fn progress(
        &mut self,
        bytes: usize,
        in_place: bool,
        done: usize,
        iters: usize,
        elapsed: Duration,
    ) {
        let each = elapsed / done as u32;
        if self.comm.rank() != 0 || each < Duration::from_millis(500) {
            return;
        }
        let terminal = std::io::stderr().is_terminal();
        let mode = if in_place { "in-place" } else { "out-of-place" };
        let line = format!(
            "collbench: {} {mode}: iteration {done}/{iters}, {:.2}s each, {:.0}s since start",
            human_bytes(bytes as u64),
            each.as_secs_f64(),
            self.started.elapsed().as_secs_f64()
        );
        if terminal {
            let (k, n) = self.sweep;
            eprint!("\r{} {line}\x1b[K", bar(k, n, self.started));
        } else if done == iters || self.logged.elapsed() >= Duration::from_secs(10) {
            // A log gets a line every 10 s, not one per iteration.
            self.logged = Instant::now();
            collectives::log::eprint_line(&line);
        }
    }
}

/// `--fresh`: a store to every cache line of a call's input, of the value
/// already there, so the line is this rank's alone again, as after a
/// compute step: a peer's copy of it from the last call is gone. A zero
/// the compiler cannot see through makes it a load and a store per line,
/// as `ci/mpibench.c`'s volatile loop (storing `black_box(byte)` went
/// through the stack, a second store per line: 2-rank AllGather of 1 MiB
/// with fresh inputs took 274 us against 198-207 this way, Open MPI 213).
fn rewrite_lines(input: &mut [u8]) {
    let zero = std::hint::black_box(0u8);
    for i in (0..input.len()).step_by(64) {
        input[i] = input[i].wrapping_add(zero);
    }
}

/// A progress bar for a sweep at size `k` (from 0) of `n`, on a terminal:
/// `[#####.....] 3/10 sizes, 12s`.
pub fn bar(k: usize, n: usize, started: Instant) -> String {
    const WIDTH: usize = 20;
    let full = WIDTH * k / n.max(1);
    format!(
        "[{}{}] {k}/{n} sizes, {:.0}s",
        "#".repeat(full),
        ".".repeat(WIDTH - full),
        started.elapsed().as_secs_f64()
    )
}

/// Shows the sweep's bar on rank 0's terminal before size `k` is measured,
/// or (`k == n`) clears it.
pub fn show_bar(rank: usize, k: usize, n: usize, started: Instant) {
    if rank != 0 || !std::io::stderr().is_terminal() {
        return;
    }
    match k < n {
        true => eprint!("\r{}\x1b[K", bar(k, n, started)),
        false => eprint!("\r\x1b[K"),
    }
}

/// This process's peak resident memory (VmHWM), in bytes.
pub fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// The datatype's element size, for the header.
pub fn describe_dtype(d: DataType) -> String {
    format!("{} ({} B)", d.name(), d.size())
}
