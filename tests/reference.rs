//! The correctness matrix one rank runs: every datatype x reduction x size x
//! in/out-of-place for allreduce, reducescatter and reduce (every root),
//! alltoall, allgather and broadcast for every datatype, on random data,
//! compared with a reference reduction computed here from every rank's
//! regenerated input (exact for integers, `approx` for floats), and results
//! checked to be bitwise identical across ranks.

use approx::abs_diff_eq;
use collectives::{Buffers, CallArgs, Collective, Communicator, DataType, ReduceOp, VarCounts};
use half::{bf16, f16};

/// Element counts every datatype and reduction runs at: empty, one, odd,
/// primes, and a 3 MiB (f32) prime-ish size that spans many chunks.
const SIZES: [usize; 5] = [0, 1, 7, 997, 65_537];
const LARGE: usize = 786_433;
/// The large size runs for these pairs only, to keep the matrix quick.
const LARGE_CASES: [(DataType, ReduceOp); 6] = [
    (DataType::F32, ReduceOp::Sum),
    (DataType::Bf16, ReduceOp::Avg),
    (DataType::F16, ReduceOp::Max),
    (DataType::I64, ReduceOp::Prod),
    (DataType::U8, ReduceOp::Min),
    (DataType::F64, ReduceOp::Sum),
];

/// Runs the whole matrix; every rank runs every case even after a failure,
/// so the ranks stay in step. Returns the failures, if any.
pub fn run(comm: &mut Communicator) -> Result<(), String> {
    let mut failures = Vec::new();
    let mut case = 0u64;
    let mut cases: Vec<(DataType, ReduceOp, usize)> = Vec::new();
    for dtype in DataType::ALL {
        for op in ReduceOp::ALL {
            cases.extend(SIZES.iter().map(|&n| (dtype, op, n)));
        }
    }
    cases.extend(LARGE_CASES.iter().map(|&(d, o)| (d, o, LARGE)));
    for (dtype, op, count) in cases {
        for in_place in [false, true] {
            case += 1;
            if let Some(f) = allreduce_case(comm, dtype, op, count, in_place, case)? {
                failures.push(f);
            }
        }
    }
    for dtype in DataType::ALL {
        for block in [0, 1, 7, 997] {
            for in_place in [false, true] {
                case += 1;
                if let Some(f) = alltoall_case(comm, dtype, block, in_place, case)? {
                    failures.push(f);
                }
            }
        }
    }
    let n = comm.size();
    let mut others: Vec<(Collective, DataType, ReduceOp, usize)> = Vec::new();
    for dtype in DataType::ALL {
        for block in [0, 1, 7, 997] {
            others.push((Collective::AllGather, dtype, ReduceOp::Sum, block * n));
            for op in ReduceOp::ALL {
                others.push((Collective::ReduceScatter, dtype, op, block * n));
            }
        }
        for count in SIZES {
            others.push((Collective::Broadcast, dtype, ReduceOp::Sum, count));
            for op in ReduceOp::ALL {
                others.push((Collective::Reduce, dtype, op, count));
            }
        }
    }
    for c in [
        Collective::ReduceScatter,
        Collective::AllGather,
        Collective::Broadcast,
        Collective::Reduce,
    ] {
        others.push((c, DataType::F32, ReduceOp::Sum, LARGE / n * n));
    }
    for (c, dtype, op, count) in others {
        for in_place in [false, true] {
            case += 1;
            // Roots vary with the case: every rank is root somewhere.
            let root = c.rooted().then_some(case as usize % n);
            if let Some(f) = other_case(comm, c, dtype, op, count, root, in_place, case)? {
                failures.push(f);
            }
        }
    }
    for dtype in DataType::ALL {
        for scale in [0, 1, 7, 997] {
            case += 1;
            if let Some(f) = alltoallv_case(comm, dtype, scale, case)? {
                failures.push(f);
            }
        }
    }
    for dtype in DataType::ALL {
        for count in SIZES {
            case += 1;
            if let Some(f) = p2p_case(comm, dtype, count, case)? {
                failures.push(f);
            }
        }
    }
    for _ in 0..3 {
        comm.barrier().map_err(|e| e.to_string())?;
    }
    if failures.is_empty() {
        Ok(())
    } else {
        let n = failures.len();
        failures.truncate(20);
        Err(format!(
            "rank {}: {n} failed case(s):\n  {}",
            comm.rank(),
            failures.join("\n  ")
        ))
    }
}

fn allreduce_case(
    comm: &mut Communicator,
    dtype: DataType,
    op: ReduceOp,
    count: usize,
    in_place: bool,
    case: u64,
) -> Result<Option<String>, String> {
    let (n, me) = (comm.size(), comm.rank());
    let inputs: Vec<Vec<Val>> = (0..n).map(|r| random(dtype, op, count, case, r)).collect();
    let mine = encode(dtype, &inputs[me]);
    let mut out = Aligned::new(mine.len());
    let e = |e: collectives::Error| e.to_string();
    if in_place {
        out.bytes().copy_from_slice(&mine);
        comm.all_reduce_bytes(Buffers::InPlace(out.bytes()), dtype, op)
            .map_err(e)?;
    } else {
        let input = Aligned::from(&mine);
        let bufs = Buffers::OutOfPlace {
            send: input.view(),
            recv: out.bytes(),
        };
        comm.all_reduce_bytes(bufs, dtype, op).map_err(e)?;
    }
    let got = decode(dtype, out.view());
    let label = format!("allreduce {dtype} {op} count {count} {}", place(in_place));
    let wrong = (0..count).find(|&i| !matches_reference(dtype, op, &inputs, i, got[i]));
    if let Some(i) = wrong {
        let (want, tol) = reference(dtype, op, &inputs, i);
        return Ok(Some(format!(
            "{label}: element {i} is {:?}, expected {want:?} (tolerance {tol:e})",
            got[i]
        )));
    }
    if !same_on_every_rank(comm, out.view())? {
        return Ok(Some(format!("{label}: ranks hold different bits")));
    }
    Ok(None)
}

fn alltoall_case(
    comm: &mut Communicator,
    dtype: DataType,
    block: usize,
    in_place: bool,
    case: u64,
) -> Result<Option<String>, String> {
    let (n, me) = (comm.size(), comm.rank());
    let count = block * n;
    let inputs: Vec<Vec<Val>> = (0..n)
        .map(|r| random(dtype, ReduceOp::Sum, count, case, r))
        .collect();
    let mine = encode(dtype, &inputs[me]);
    let mut out = Aligned::new(mine.len());
    let e = |e: collectives::Error| e.to_string();
    if in_place {
        out.bytes().copy_from_slice(&mine);
        comm.all_to_all_bytes(Buffers::InPlace(out.bytes()), dtype)
            .map_err(e)?;
    } else {
        let input = Aligned::from(&mine);
        comm.all_to_all_bytes(
            Buffers::OutOfPlace {
                send: input.view(),
                recv: out.bytes(),
            },
            dtype,
        )
        .map_err(e)?;
    }
    let got = decode(dtype, out.view());
    for (i, &got) in got.iter().enumerate() {
        let (from, k) = (i / block, i % block);
        let want = inputs[from][me * block + k];
        if got != want {
            return Ok(Some(format!(
                "alltoall {dtype} block {block} {}: element {i} is {:?}, expected {want:?} (from rank {from})",
                place(in_place),
                got
            )));
        }
    }
    Ok(None)
}

/// ReduceScatter, AllGather, Broadcast or Reduce on `count` elements (of
/// the larger buffer), checked against the reference on every rank that
/// gets a result.
#[allow(clippy::too_many_arguments)]
fn other_case(
    comm: &mut Communicator,
    c: Collective,
    dtype: DataType,
    op: ReduceOp,
    count: usize,
    root: Option<usize>,
    in_place: bool,
    case: u64,
) -> Result<Option<String>, String> {
    let (n, me) = (comm.size(), comm.rank());
    let block = count / n;
    let send_count = if c == Collective::AllGather {
        block
    } else {
        count
    };
    let inputs: Vec<Vec<Val>> = (0..n)
        .map(|r| random(dtype, op, send_count, case, r))
        .collect();
    let mine = encode(dtype, &inputs[me]);
    let elem = dtype.size();
    let recv_count = match (c, in_place) {
        (_, true) | (Collective::AllGather, _) => count,
        (Collective::ReduceScatter, false) => block,
        _ => count,
    };
    let mut out = Aligned::new(recv_count * elem);
    // Whatever the call must overwrite starts as garbage.
    out.bytes().fill(0xa5);
    let input = Aligned::from(&mine);
    let bufs = if in_place {
        match c {
            Collective::AllGather => {
                out.bytes()[me * block * elem..][..mine.len()].copy_from_slice(&mine)
            }
            _ => out.bytes().copy_from_slice(&mine),
        }
        Buffers::InPlace(out.bytes())
    } else {
        Buffers::OutOfPlace {
            send: input.view(),
            recv: out.bytes(),
        }
    };
    let reduces = c.reduces().then_some(op);
    comm.collective_bytes(c, bufs, dtype, reduces, root)
        .map_err(|e| e.to_string())?;
    let got = decode(dtype, out.view());
    // (index in `got`, what it must be)
    let expected: Vec<(usize, Val, f64)> = match c {
        Collective::ReduceScatter => {
            let at = if in_place { me * block } else { 0 };
            (0..block)
                .map(|k| {
                    let (want, tol) = reference(dtype, op, &inputs, me * block + k);
                    (at + k, want, tol)
                })
                .collect()
        }
        Collective::AllGather => (0..count)
            .map(|i| (i, inputs[i / block][i % block], 0.0))
            .collect(),
        Collective::Broadcast => (0..count)
            .map(|i| (i, inputs[root.unwrap()][i], 0.0))
            .collect(),
        _ if root != Some(me) => Vec::new(),
        _ => (0..count)
            .map(|i| {
                let (want, tol) = reference(dtype, op, &inputs, i);
                (i, want, tol)
            })
            .collect(),
    };
    for (i, want, tol) in expected {
        let ok = match (want, got[i]) {
            (Val::F(w), Val::F(g)) => abs_diff_eq!(g, w, epsilon = tol),
            (w, g) => w == g,
        };
        if !ok {
            let root = root.map_or(String::new(), |r| format!(" root {r}"));
            return Ok(Some(format!(
                "{c} {dtype} {} count {count}{root} {}: element {i} is {:?}, expected {want:?} (tolerance {tol:e})",
                reduces.map_or(String::new(), |o| o.to_string()),
                place(in_place),
                got[i]
            )));
        }
    }
    Ok(None)
}

/// What rank `from` sends rank `to` in an AllToAllv case: a skewed count
/// (some pairs nothing, the last rank nothing at all), the same formula on
/// every rank so counts match.
fn pair_count(from: usize, to: usize, n: usize, scale: usize) -> usize {
    if from == n - 1 && n > 1 {
        return 0;
    }
    (scale * ((from * 7 + to * 3) % 5)) / 2
}

/// AllToAllv with skewed counts and gaps between the receive blocks (which
/// must stay untouched), checked block by block.
fn alltoallv_case(
    comm: &mut Communicator,
    dtype: DataType,
    scale: usize,
    case: u64,
) -> Result<Option<String>, String> {
    let (n, me) = (comm.size(), comm.rank());
    let send_counts: Vec<usize> = (0..n).map(|j| pair_count(me, j, n, scale)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|j| pair_count(j, me, n, scale)).collect();
    let mut counts = VarCounts::packed(&send_counts, &recv_counts);
    // One element of gap before each receive block.
    for (j, d) in counts.recv_displs.iter_mut().enumerate() {
        *d += j + 1;
    }
    let recv_len = counts.recv_displs[n - 1] + recv_counts[n - 1] + 1;
    let inputs: Vec<Vec<Val>> = (0..n)
        .map(|r| {
            let total = (0..n).map(|j| pair_count(r, j, n, scale)).sum();
            random(dtype, ReduceOp::Sum, total, case, r)
        })
        .collect();
    let input = Aligned::from(&encode(dtype, &inputs[me]));
    let mut out = Aligned::new(recv_len * dtype.size());
    out.bytes().fill(0xa5);
    let garbage = decode(dtype, out.view())[0];
    let args = CallArgs::all_to_all_v(dtype, counts.clone());
    let bufs = Buffers::OutOfPlace {
        send: input.view(),
        recv: out.bytes(),
    };
    comm.call(&args, bufs).map_err(|e| e.to_string())?;
    let got = decode(dtype, out.view());
    for (i, &g) in got.iter().enumerate() {
        let block = (0..n)
            .find(|&j| i >= counts.recv_displs[j] && i < counts.recv_displs[j] + recv_counts[j]);
        let want = match block {
            Some(j) => {
                let k = i - counts.recv_displs[j];
                let offset: usize = (0..me).map(|t| pair_count(j, t, n, scale)).sum();
                inputs[j][offset + k]
            }
            None => garbage,
        };
        if g != want {
            return Ok(Some(format!(
                "alltoallv {dtype} scale {scale}: element {i} is {g:?}, expected {want:?} ({})",
                block.map_or("a gap".to_string(), |j| format!("from rank {j}"))
            )));
        }
    }
    Ok(None)
}

/// Point-to-point around the ring, blocking: even ranks send first, odd
/// ones receive first.
fn p2p_case(
    comm: &mut Communicator,
    dtype: DataType,
    count: usize,
    case: u64,
) -> Result<Option<String>, String> {
    let (n, me) = (comm.size(), comm.rank());
    if n == 1 {
        return Ok(None);
    }
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let inputs: Vec<Vec<Val>> = (0..n)
        .map(|r| random(dtype, ReduceOp::Sum, count, case, r))
        .collect();
    let mine = Aligned::from(&encode(dtype, &inputs[me]));
    let mut out = Aligned::new(mine.view().len());
    out.bytes().fill(0xa5);
    let e = |e: collectives::Error| e.to_string();
    let send = |comm: &mut Communicator| {
        let bufs = Buffers::OutOfPlace {
            send: mine.view(),
            recv: &mut [],
        };
        comm.call(&CallArgs::send_to(dtype, next), bufs)
    };
    let recv = |comm: &mut Communicator, out: &mut Aligned| {
        comm.call(
            &CallArgs::recv_from(dtype, prev),
            Buffers::InPlace(out.bytes()),
        )
    };
    if me % 2 == 0 {
        send(comm).map_err(e)?;
        recv(comm, &mut out).map_err(e)?;
    } else {
        recv(comm, &mut out).map_err(e)?;
        send(comm).map_err(e)?;
    }
    let got = decode(dtype, out.view());
    if let Some(i) = (0..count).find(|&i| got[i] != inputs[prev][i]) {
        return Ok(Some(format!(
            "send/recv {dtype} count {count}: element {i} from rank {prev} is {:?}, expected {:?}",
            got[i], inputs[prev][i]
        )));
    }
    Ok(None)
}

fn place(in_place: bool) -> &'static str {
    if in_place {
        "in-place"
    } else {
        "out-of-place"
    }
}

/// Every rank holds the same bytes: max of (h, !h) over ranks is (h, !h).
fn same_on_every_rank(comm: &mut Communicator, bytes: &[u8]) -> Result<bool, String> {
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let mut v = [h, !h];
    comm.all_reduce_in_place(&mut v, ReduceOp::Max)
        .map_err(|e| e.to_string())?;
    Ok(v == [h, !h])
}

/// One element, as the reference sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Val {
    F(f64),
    I(i128),
}

/// splitmix64: the same stream on every rank for a given (case, rank).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Rank `rank`'s input for a case: floats in [-1, 1) (prod: magnitudes in
/// [0.5, 1.5) so products stay normal), integers over their whole range.
fn random(dtype: DataType, op: ReduceOp, count: usize, case: u64, rank: usize) -> Vec<Val> {
    let mut rng = Rng(case.wrapping_mul(1_000_003) ^ (rank as u64) << 40);
    (0..count)
        .map(|_| {
            if dtype.is_float() {
                let x = match op {
                    ReduceOp::Prod => {
                        (0.5 + rng.unit()) * if rng.next() & 1 == 0 { 1.0 } else { -1.0 }
                    }
                    _ => rng.unit() * 2.0 - 1.0,
                };
                Val::F(round(dtype, x))
            } else {
                Val::I(wrap(dtype, rng.next() as i128))
            }
        })
        .collect()
}

/// `x` rounded to `dtype`'s precision.
fn round(dtype: DataType, x: f64) -> f64 {
    match dtype {
        DataType::F32 => x as f32 as f64,
        DataType::F16 => f16::from_f64(x).to_f64(),
        DataType::Bf16 => bf16::from_f64(x).to_f64(),
        _ => x,
    }
}

/// `x` reduced modulo 2^bits into `dtype`'s range: two's-complement wrapping.
fn wrap(dtype: DataType, x: i128) -> i128 {
    let bits = 8 * dtype.size() as u32;
    let m = (x as u128) & (u128::MAX >> (128 - bits));
    let signed = matches!(dtype, DataType::I8 | DataType::I32 | DataType::I64);
    if signed && m >> (bits - 1) == 1 {
        m as i128 - (1i128 << bits)
    } else {
        m as i128
    }
}

/// The expected value of element `i` and the tolerance allowed (floats).
fn reference(dtype: DataType, op: ReduceOp, inputs: &[Vec<Val>], i: usize) -> (Val, f64) {
    let n = inputs.len();
    let xs: Vec<Val> = inputs.iter().map(|v| v[i]).collect();
    if !dtype.is_float() {
        let v: Vec<i128> = xs
            .iter()
            .map(|x| {
                if let Val::I(v) = x {
                    *v
                } else {
                    unreachable!()
                }
            })
            .collect();
        let r = match op {
            ReduceOp::Sum => wrap(dtype, v.iter().fold(0i128, |a, b| a.wrapping_add(*b))),
            ReduceOp::Prod => wrap(
                dtype,
                v.iter().fold(1u128, |a, b| a.wrapping_mul(*b as u128)) as i128,
            ),
            ReduceOp::Min => *v.iter().min().unwrap(),
            ReduceOp::Max => *v.iter().max().unwrap(),
            // The wrapped sum divided, truncating toward zero.
            ReduceOp::Avg => {
                wrap(dtype, v.iter().fold(0i128, |a, b| a.wrapping_add(*b))) / n as i128
            }
        };
        return (Val::I(r), 0.0);
    }
    let v: Vec<f64> = xs
        .iter()
        .map(|x| {
            if let Val::F(v) = x {
                *v
            } else {
                unreachable!()
            }
        })
        .collect();
    // Unit roundoff of the type the library accumulates in at each step.
    let eps = match dtype {
        DataType::F64 => f64::EPSILON,
        DataType::F32 => f32::EPSILON as f64,
        DataType::F16 => 2f64.powi(-10),
        _ => 2f64.powi(-7),
    };
    let steps = (n + 2) as f64;
    let abs_sum: f64 = v.iter().map(|x| x.abs()).sum();
    match op {
        ReduceOp::Sum => (Val::F(v.iter().sum()), steps * eps * abs_sum),
        ReduceOp::Avg => (
            Val::F(v.iter().sum::<f64>() / n as f64),
            steps * eps * abs_sum,
        ),
        ReduceOp::Prod => {
            let p: f64 = v.iter().product();
            (Val::F(p), steps * eps * p.abs())
        }
        ReduceOp::Min => (Val::F(v.iter().copied().fold(f64::INFINITY, f64::min)), 0.0),
        ReduceOp::Max => (
            Val::F(v.iter().copied().fold(f64::NEG_INFINITY, f64::max)),
            0.0,
        ),
    }
}

fn matches_reference(
    dtype: DataType,
    op: ReduceOp,
    inputs: &[Vec<Val>],
    i: usize,
    got: Val,
) -> bool {
    match (reference(dtype, op, inputs, i), got) {
        ((Val::F(want), tol), Val::F(got)) => abs_diff_eq!(got, want, epsilon = tol),
        ((want, _), got) => want == got,
    }
}

fn encode(dtype: DataType, vals: &[Val]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    for v in vals {
        match (*v, dtype) {
            (Val::F(x), DataType::F32) => out.extend((x as f32).to_le_bytes()),
            (Val::F(x), DataType::F64) => out.extend(x.to_le_bytes()),
            (Val::F(x), DataType::F16) => out.extend(f16::from_f64(x).to_le_bytes()),
            (Val::F(x), DataType::Bf16) => out.extend(bf16::from_f64(x).to_le_bytes()),
            (Val::I(x), _) => out.extend(&(x as u128).to_le_bytes()[..dtype.size()]),
            (Val::F(_), _) => unreachable!("float value for an integer type"),
        }
    }
    out
}

fn decode(dtype: DataType, bytes: &[u8]) -> Vec<Val> {
    bytes
        .chunks_exact(dtype.size())
        .map(|b| match dtype {
            DataType::F32 => Val::F(f32::from_le_bytes(b.try_into().unwrap()) as f64),
            DataType::F64 => Val::F(f64::from_le_bytes(b.try_into().unwrap())),
            DataType::F16 => Val::F(f16::from_le_bytes(b.try_into().unwrap()).to_f64()),
            DataType::Bf16 => Val::F(bf16::from_le_bytes(b.try_into().unwrap()).to_f64()),
            _ => {
                let mut w = [0u8; 16];
                w[..b.len()].copy_from_slice(b);
                Val::I(wrap(dtype, u128::from_le_bytes(w) as i128))
            }
        })
        .collect()
}

/// Bytes aligned for any datatype (the library checks alignment).
struct Aligned(Vec<u64>, usize);

impl Aligned {
    fn new(len: usize) -> Self {
        Aligned(vec![0; len.div_ceil(8)], len)
    }
    fn from(bytes: &[u8]) -> Self {
        let mut a = Self::new(bytes.len());
        a.bytes().copy_from_slice(bytes);
        a
    }
    fn bytes(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.0)[..self.1]
    }
    fn view(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.0)[..self.1]
    }
}
