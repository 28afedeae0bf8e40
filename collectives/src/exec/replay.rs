//! Every rank's schedule run by the executor in one thread, with real data
//! and transfers that copy at random moments between posting and
//! completion, in random parts and a random order: a step that touches memory before its
//! `after` edges allow shows up as a wrong result, whatever the timing of
//! real transports would have hidden.

use std::collections::{HashMap, VecDeque};

use transport::Tag;

use crate::algo::schedule::{Action, Buf, Schedule, Span, Step};
use crate::algo::{Algorithm, Layout};
use crate::exec::executor::{Effects, Execution, Progress, Source, Windows};
use crate::{Collective, DataType};

struct Memory {
    input: Vec<u64>,
    output: Vec<u64>,
    scratch: Vec<u64>,
    slots: Vec<Vec<u64>>,
}

impl Memory {
    fn read(&self, span: Span) -> Vec<u64> {
        let buf = match span.buf {
            Buf::Input => &self.input,
            Buf::Output => &self.output,
            Buf::Scratch => &self.scratch,
        };
        buf[span.offset / 8..][..span.len / 8].to_vec()
    }

    fn write(&mut self, span: Span) -> &mut [u64] {
        let buf = match span.buf {
            Buf::Input => panic!("the input is never written"),
            Buf::Output => &mut self.output,
            Buf::Scratch => &mut self.scratch,
        };
        &mut buf[span.offset / 8..][..span.len / 8]
    }
}

struct Transfer {
    src: usize,
    send: Span,
    dst: usize,
    recv: Option<(Span, Option<usize>)>,
    /// Bytes landed so far, from the start.
    landed: usize,
    done: bool,
}

struct Replay<'a> {
    me: usize,
    memory: &'a mut [Memory],
    transfers: &'a mut Vec<Transfer>,
    /// Transfers posted by their sender only, by (src, dst); by their receiver only.
    sends: &'a mut HashMap<(usize, usize), VecDeque<usize>>,
    recvs: &'a mut HashMap<(usize, usize), VecDeque<usize>>,
    rng: &'a mut u64,
}

impl Replay<'_> {
    fn coin(&mut self) -> bool {
        *self.rng ^= *self.rng << 13;
        *self.rng ^= *self.rng >> 7;
        *self.rng ^= *self.rng << 17;
        *self.rng % 3 == 0
    }
}

impl Effects for Replay<'_> {
    type Token = usize;

    fn post(
        &mut self,
        step: &Step,
        _: Option<Tag>,
        slot: Option<usize>,
    ) -> transport::Result<usize> {
        let send = step.is_send();
        let key = match send {
            true => (self.me, step.peer()),
            false => (step.peer(), self.me),
        };
        let (mine, theirs) = match send {
            true => (&mut *self.sends, &mut *self.recvs),
            false => (&mut *self.recvs, &mut *self.sends),
        };
        let id = match theirs.get_mut(&key).and_then(|q| q.pop_front()) {
            Some(id) => id,
            None => {
                mine.entry(key).or_default().push_back(self.transfers.len());
                self.transfers.push(placeholder());
                self.transfers.len() - 1
            }
        };
        let t = &mut self.transfers[id];
        match send {
            true => (t.src, t.dst, t.send) = (key.0, key.1, step.span()),
            false => t.recv = Some((step.span(), slot)),
        }
        Ok(id)
    }

    fn is_done(&mut self, _peer: usize, token: usize) -> transport::Result<bool> {
        Ok(self.transfers[token].done)
    }

    fn landed(&mut self, _peer: usize, token: usize) -> usize {
        self.transfers[token].landed
    }

    fn progress(&mut self, _involved: &[bool]) -> transport::Result<bool> {
        let mut moved = false;
        for id in 0..self.transfers.len() {
            let t = &self.transfers[id];
            let Some((span, slot)) = t.recv else { continue };
            if t.src == usize::MAX || t.done {
                continue;
            }
            if !self.coin() {
                continue;
            }
            let t = &self.transfers[id];
            assert_eq!(
                t.send.len, span.len,
                "rank {} -> {}: lengths differ",
                t.src, t.dst
            );
            if t.landed == span.len {
                self.transfers[id].done = true;
                moved = true;
                continue;
            }
            // A random part of what is left lands, whole elements.
            let (src, send, from, left) = (t.src, t.send, t.landed, span.len - t.landed);
            let len = match left > 8 && self.coin() {
                true => (*self.rng as usize % (left / 8)).max(1) * 8,
                false => left,
            };
            let data = self.memory[src].read(send.part(from, len));
            let dst = &mut self.memory[self.transfers[id].dst];
            match slot {
                Some(s) => dst.slots[s][from / 8..][..data.len()].copy_from_slice(&data),
                None => dst.write(span.part(from, len)).copy_from_slice(&data),
            }
            self.transfers[id].landed += len;
            moved = true;
        }
        Ok(moved)
    }

    fn apply(&mut self, action: Action, span: Span, from: Source) {
        let m = &mut self.memory[self.me];
        let operand = match from {
            Source::Slot(s, from) => m.slots[s][from / 8..][..span.len / 8].to_vec(),
            Source::Local(f) => m.read(f),
            Source::Span => m.read(span),
        };
        match action {
            Action::Copy => m.write(span).copy_from_slice(&operand),
            Action::Reduce { with_input, .. } => {
                let input = Span {
                    buf: Buf::Input,
                    ..span
                };
                let base = with_input.then(|| m.read(input));
                let out = m.write(span);
                for (i, o) in out.iter_mut().enumerate() {
                    let acc = base.as_ref().map_or(*o, |b| b[i]);
                    *o = acc.wrapping_add(operand[i]);
                }
            }
        }
    }

    fn copy(&mut self, from: Span, to: Span) {
        let data = self.memory[self.me].read(from);
        self.memory[self.me].write(to).copy_from_slice(&data);
    }
}

fn placeholder() -> Transfer {
    let span = Span {
        buf: Buf::Output,
        offset: 0,
        len: 0,
    };
    Transfer {
        src: usize::MAX,
        send: span,
        dst: usize::MAX,
        recv: None,
        landed: 0,
        done: false,
    }
}

/// Runs `algo` (an AllReduce or ReduceScatter of u64 sums, an AllToAll or
/// an AllGather) on `n` ranks and checks every rank's result.
fn check(algo: &Algorithm, n: usize, count: usize, chunk: usize, in_place: bool, seed: u64) {
    let hosts: Vec<Vec<usize>> = (0..n)
        .collect::<Vec<_>>()
        .chunks(2)
        .map(|c| c.to_vec())
        .collect();
    let value = |r: usize, i: usize| ((r as u64 + 1) << 32) ^ (i as u64 * 7919);
    let layout = |rank| {
        let c = algo.collective;
        Layout::of_call(c, DataType::U64, rank, n, count, chunk, in_place, &hosts)
    };
    // AllGather's and ReduceScatter's blocks, in elements.
    let block_of = |r: usize| {
        let (offset, len) = layout(0).block(r);
        (offset / 8, len / 8)
    };
    let slots = 3;
    let mut memory: Vec<Memory> = (0..n)
        .map(|r| {
            let data: Vec<u64> = (0..count).map(|i| value(r, i)).collect();
            let (input, output) = match (algo.collective, in_place) {
                (Collective::AllGather, false) => (data[..block_of(r).1].to_vec(), vec![0; count]),
                (Collective::AllGather, true) => {
                    let (start, len) = block_of(r);
                    let mut output = vec![0; count];
                    output[start..start + len].copy_from_slice(&data[..len]);
                    (Vec::new(), output)
                }
                (_, false) => (data, vec![0; count]),
                (_, true) => (Vec::new(), data),
            };
            Memory {
                input,
                output,
                scratch: Vec::new(),
                slots: vec![vec![0; chunk / 8]; slots],
            }
        })
        .collect();
    let mut runs: Vec<(Schedule, Execution<usize>)> = (0..n)
        .map(|rank| {
            let l = layout(rank);
            let mut s = Schedule::default();
            (algo.build)(&l, &mut s);
            memory[rank].scratch = vec![0; s.scratch.div_ceil(8)];
            let mut e = Execution::default();
            let windows = Windows {
                sends: 4,
                recvs: 2,
                slots,
            };
            e.start(&s, n, windows);
            (s, e)
        })
        .collect();
    let (mut transfers, mut sends, mut recvs) = (Vec::new(), HashMap::new(), HashMap::new());
    let mut rng = seed * 2 + 1;
    let mut finished = vec![false; n];
    for round in 0.. {
        assert!(
            round < 1_000_000,
            "{} on {n} ranks never finished",
            algo.name
        );
        if finished.iter().all(|f| *f) {
            break;
        }
        for (me, (s, e)) in runs.iter_mut().enumerate() {
            if finished[me] {
                continue;
            }
            let mut fx = Replay {
                me,
                memory: &mut memory,
                transfers: &mut transfers,
                sends: &mut sends,
                recvs: &mut recvs,
                rng: &mut rng,
            };
            finished[me] = e.progress(s, &mut fx).unwrap() == Progress::Done;
        }
    }
    let block = count / n;
    let want = |r: usize, i: usize| match algo.collective {
        Collective::AllReduce | Collective::ReduceScatter => {
            (0..n).fold(0u64, |a, k| a.wrapping_add(value(k, i)))
        }
        // Block j of rank r's output is block r of rank j's input.
        Collective::AllToAll => value(i / block, r * block + i % block),
        // Element i of every output is element i - start of its owner's block.
        Collective::AllGather => {
            let owner = (0..n).rfind(|&k| block_of(k).0 <= i && block_of(k).1 > 0);
            let k = owner.expect("element in a block");
            value(k, i - block_of(k).0)
        }
        c => unreachable!("{c} is not replayed"),
    };
    for (r, m) in memory.iter().enumerate() {
        // A ReduceScatter's result is block r alone.
        let result = match algo.collective {
            Collective::ReduceScatter => block_of(r),
            _ => (0, count),
        };
        let (start, len) = result;
        for (i, got) in m.output.iter().enumerate().skip(start).take(len) {
            let want = want(r, i);
            assert_eq!(
                *got, want,
                "{} on {n} ranks, {count} elements, chunk {chunk}, in place {in_place}, seed {seed}: rank {r} element {i}",
                algo.name
            );
        }
    }
}

#[test]
fn large_slices_cross_hosts_by_ring_in_the_hierarchical_allreduce() {
    // Slices above the tree's limit (2 ranks per host here).
    for n in [4, 6] {
        let hosts = n / 2;
        let count = 2 * crate::algo::hierarchical::TREE_SLICE_BYTES_PER_HOST * hosts / 8 + 24;
        for in_place in [false, true] {
            check(
                &crate::algo::hierarchical::ALLREDUCE,
                n,
                count,
                8192,
                in_place,
                n as u64,
            );
        }
    }
}

#[test]
fn every_alltoall_is_right_whatever_the_timing() {
    for algo in crate::algo::ALGORITHMS
        .iter()
        .filter(|a| a.collective == Collective::AllToAll)
    {
        for n in 1..=9 {
            for per_rank in [0, 1, 3, 40] {
                for chunk in [16, 256] {
                    for in_place in [false, true] {
                        for seed in 0..3 {
                            check(algo, n, per_rank * n, chunk, in_place, seed);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn every_allgather_and_reduce_scatter_is_right_whatever_the_timing() {
    for algo in crate::algo::ALGORITHMS.iter().filter(|a| {
        matches!(
            a.collective,
            Collective::AllGather | Collective::ReduceScatter
        )
    }) {
        for n in 1..=9 {
            for count in [0, 1, 5, 37, 300] {
                for chunk in [16, 256] {
                    for in_place in [false, true] {
                        for seed in 0..3 {
                            check(algo, n, count, chunk, in_place, seed);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn every_allreduce_is_right_whatever_the_timing() {
    for algo in crate::algo::ALGORITHMS
        .iter()
        .filter(|a| a.collective == Collective::AllReduce)
    {
        for n in 1..=9 {
            for count in [0, 1, 5, 37, 300] {
                for chunk in [16, 256] {
                    for in_place in [false, true] {
                        if in_place && !algo.in_place {
                            continue;
                        }
                        for seed in 0..3 {
                            check(algo, n, count, chunk, in_place, seed);
                        }
                    }
                }
            }
        }
    }
}
