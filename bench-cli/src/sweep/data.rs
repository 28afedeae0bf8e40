//! Input patterns and their expected results, in closed form and periodic, so
//! that filling is a repeated copy and checking a slice comparison: a 1 GiB
//! result is checked at memory speed whatever the rank count.
//!
//! Rank r's element i holds `b(i) + r` (sum, min, max, avg, alltoall) or
//! `s(i) * t(r)` with `t(r)` in {1, 2} (prod), where `b` and `s` repeat every
//! [`PERIOD`] elements (a prime, so a block landing at a wrong power-of-two
//! offset shows). The values are small integers, exact in every datatype, so
//! any reduction order gives the same bits and a wrong element is a real
//! error. Floats get a tolerance only where rank counts push sums past their
//! mantissa (bf16 beyond 256).

use collectives::{DataType, ReduceOp};
use half::{bf16, f16};

/// Elements before the pattern repeats.
pub const PERIOD: usize = 1021;

/// Hash of the element index within the period.
#[inline(always)]
fn h(i: usize) -> u64 {
    ((i % PERIOD) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58
}

/// `b(i)`: in [-4, 3] for signed types and floats, [0, 7] for unsigned.
#[inline(always)]
fn base(i: usize, signed: bool) -> i64 {
    (h(i) & 7) as i64 - if signed { 4 } else { 0 }
}

/// `s(i)`: ±1 for signed types and floats, 1 or 3 for unsigned.
#[inline(always)]
fn sign(i: usize, signed: bool) -> i64 {
    match (h(i) & 1, signed) {
        (0, _) => 1,
        (_, true) => -1,
        (_, false) => 3,
    }
}

fn factor(rank: usize) -> i64 {
    1 + (rank % 2) as i64
}

/// Rank `rank`'s input element `i` for a reduction `op`.
#[inline(always)]
fn input(op: ReduceOp, signed: bool, rank: usize, i: usize) -> i64 {
    match op {
        ReduceOp::Prod => sign(i, signed) * factor(rank),
        _ => base(i, signed) + rank as i64,
    }
}

/// What every rank should hold at element `i` after an allreduce over `n`
/// ranks, before the division of avg (see [`Value::average`]).
#[inline(always)]
fn reduced(op: ReduceOp, signed: bool, n: usize, i: usize) -> i64 {
    let n64 = n as i64;
    match op {
        ReduceOp::Sum | ReduceOp::Avg => n64 * base(i, signed) + n64 * (n64 - 1) / 2,
        ReduceOp::Min => base(i, signed),
        ReduceOp::Max => base(i, signed) + n64 - 1,
        ReduceOp::Prod => {
            let twos = (0..n).map(factor).fold(1i64, i64::wrapping_mul);
            sign(i, signed).wrapping_pow(n as u32).wrapping_mul(twos)
        }
    }
}

/// Element types as the checker sees them.
trait Value: bytemuck::Pod + PartialEq {
    const SIGNED: bool;
    /// Largest integer the type holds exactly (floats), for tolerances.
    const EXACT_UP_TO: f64 = f64::INFINITY;
    fn from_i64(v: i64) -> Self;
    /// The library's avg: the sum in this type divided by n, rounded once.
    fn average(sum: i64, n: usize) -> Self;
    fn to_f64(self) -> f64;
}

macro_rules! int_value {
    ($($t:ty: $signed:expr),*) => {$(
        impl Value for $t {
            const SIGNED: bool = $signed;
            fn from_i64(v: i64) -> Self { v as $t }
            fn average(sum: i64, n: usize) -> Self { ((sum as $t) as i64 / n as i64) as $t }
            fn to_f64(self) -> f64 { self as f64 }
        }
    )*};
}
int_value!(i8: true, u8: false, i32: true, u32: false, i64: true);

impl Value for u64 {
    const SIGNED: bool = false;
    fn from_i64(v: i64) -> Self {
        v as u64
    }
    fn average(sum: i64, n: usize) -> Self {
        sum as u64 / n as u64
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Value for f32 {
    const SIGNED: bool = true;
    const EXACT_UP_TO: f64 = (1u64 << 24) as f64;
    fn from_i64(v: i64) -> Self {
        v as f32
    }
    fn average(sum: i64, n: usize) -> Self {
        sum as f32 / n as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Value for f64 {
    const SIGNED: bool = true;
    const EXACT_UP_TO: f64 = (1u64 << 53) as f64;
    fn from_i64(v: i64) -> Self {
        v as f64
    }
    fn average(sum: i64, n: usize) -> Self {
        sum as f64 / n as f64
    }
    fn to_f64(self) -> f64 {
        self
    }
}

impl Value for f16 {
    const SIGNED: bool = true;
    const EXACT_UP_TO: f64 = 2048.0;
    fn from_i64(v: i64) -> Self {
        f16::from_f32(v as f32)
    }
    fn average(sum: i64, n: usize) -> Self {
        f16::from_f32(f16::from_f32(sum as f32).to_f32() / n as f32)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
}

impl Value for bf16 {
    const SIGNED: bool = true;
    const EXACT_UP_TO: f64 = 256.0;
    fn from_i64(v: i64) -> Self {
        bf16::from_f32(v as f32)
    }
    fn average(sum: i64, n: usize) -> Self {
        bf16::from_f32(bf16::from_f32(sum as f32).to_f32() / n as f32)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
}

/// Runs `$body` with `$T` bound to the Rust type of `$dtype`.
macro_rules! with_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DataType::F32 => {
                type $T = f32;
                $body
            }
            DataType::F64 => {
                type $T = f64;
                $body
            }
            DataType::F16 => {
                type $T = f16;
                $body
            }
            DataType::Bf16 => {
                type $T = bf16;
                $body
            }
            DataType::I8 => {
                type $T = i8;
                $body
            }
            DataType::U8 => {
                type $T = u8;
                $body
            }
            DataType::I32 => {
                type $T = i32;
                $body
            }
            DataType::U32 => {
                type $T = u32;
                $body
            }
            DataType::I64 => {
                type $T = i64;
                $body
            }
            DataType::U64 => {
                type $T = u64;
                $body
            }
        }
    };
}

/// Writes rank `rank`'s allreduce input for `op` into `buf`.
pub fn fill_allreduce(buf: &mut [u8], dtype: DataType, op: ReduceOp, rank: usize) {
    with_type!(dtype, T => fill(buf, &table::<T>(|i| T::from_i64(input(op, T::SIGNED, rank, i)))))
}

/// Writes rank `rank`'s alltoall input into `buf`.
pub fn fill_alltoall(buf: &mut [u8], dtype: DataType, rank: usize) {
    with_type!(dtype, T => fill(buf, &table::<T>(|i| T::from_i64(input(ReduceOp::Sum, T::SIGNED, rank, i)))))
}

/// Elements of an allreduce result over `n` ranks that are wrong.
pub fn check_allreduce(buf: &[u8], dtype: DataType, op: ReduceOp, n: usize) -> u64 {
    check_reduced_from(buf, dtype, op, n, 0)
}

/// Like [`check_allreduce`] for a part of the result that starts at element
/// `first` (a reducescatter's block).
pub fn check_reduced_from(
    buf: &[u8],
    dtype: DataType,
    op: ReduceOp,
    n: usize,
    first: usize,
) -> u64 {
    with_type!(dtype, T => {
        let want = table::<T>(|i| {
            let r = reduced(op, T::SIGNED, n, i);
            if op == ReduceOp::Avg { T::average(r, n) } else { T::from_i64(r) }
        });
        count_wrong::<T>(buf, &want, first % PERIOD, n)
    })
}

/// Elements of `buf` that are not rank `from`'s [`fill_alltoall`] pattern
/// from element `first` on (an alltoall or allgather block, a broadcast
/// result).
pub fn check_copy_of(buf: &[u8], dtype: DataType, from: usize, first: usize) -> u64 {
    with_type!(dtype, T => {
        let want = table::<T>(|i| T::from_i64(input(ReduceOp::Sum, T::SIGNED, from, i)));
        count_wrong::<T>(buf, &want, first % PERIOD, 1)
    })
}

/// Elements of rank `rank`'s alltoall result over `n` ranks that are wrong:
/// block j holds rank j's block `rank`.
pub fn check_alltoall(buf: &[u8], dtype: DataType, rank: usize, n: usize) -> u64 {
    let block = buf.len() / n;
    let first = rank * block / dtype.size();
    (0..n)
        .map(|from| check_copy_of(&buf[from * block..][..block], dtype, from, first))
        .sum()
}

/// Two periods of the pattern `f`, so any phase has a whole period after it.
fn table<T: Value>(f: impl Fn(usize) -> T) -> Vec<T> {
    (0..2 * PERIOD).map(|i| f(i % PERIOD)).collect()
}

fn fill<T: Value>(buf: &mut [u8], table: &[T]) {
    let buf: &mut [T] = bytemuck::cast_slice_mut(buf);
    for chunk in buf.chunks_mut(PERIOD) {
        chunk.copy_from_slice(&table[..chunk.len()]);
    }
}

/// Counts elements of `buf` that differ from `table` read from `phase` on;
/// whole periods that match byte for byte cost one comparison.
fn count_wrong<T: Value>(buf: &[u8], table: &[T], phase: usize, n: usize) -> u64 {
    let buf: &[T] = bytemuck::cast_slice(buf);
    let want = &table[phase..phase + PERIOD];
    let mut wrong = 0;
    for chunk in buf.chunks(PERIOD) {
        let want = &want[..chunk.len()];
        if bytemuck::cast_slice::<T, u8>(chunk) != bytemuck::cast_slice::<T, u8>(want) {
            wrong += chunk
                .iter()
                .zip(want)
                .filter(|(g, w)| differs(**g, **w, n))
                .count() as u64;
        }
    }
    wrong
}

/// Beyond its exact range a float may round differently in another order:
/// allow that much (a relative 2n/2^8 for bf16, far less for the others).
fn differs<T: Value>(got: T, want: T, n: usize) -> bool {
    let (g, w) = (got.to_f64(), want.to_f64());
    let tol = if w.abs() <= T::EXACT_UP_TO {
        0.0
    } else {
        w.abs() * 2.0 * n as f64 / T::EXACT_UP_TO
    };
    got != want && ((g - w).abs() > tol || (g - w).is_nan())
}

#[cfg(test)]
mod tests {
    use super::*;
    use collectives::call::reduce;

    /// The closed forms agree with actually reducing every rank's input.
    #[test]
    fn closed_forms_match_real_reductions() {
        for dtype in DataType::ALL {
            for op in ReduceOp::ALL {
                for n in [1, 2, 3, 8] {
                    let len = 1000 * dtype.size();
                    let mut acc = vec![0u8; len];
                    fill_allreduce(&mut acc, dtype, op, 0);
                    for r in 1..n {
                        let mut x = vec![0u8; len];
                        fill_allreduce(&mut x, dtype, op, r);
                        reduce::reduce_into(dtype, op, &mut acc, &x);
                    }
                    reduce::finalize(dtype, op, &mut acc, n);
                    assert_eq!(check_allreduce(&acc, dtype, op, n), 0, "{dtype} {op} n={n}");
                    acc[len / 2] ^= 0x55;
                    assert_eq!(
                        check_allreduce(&acc, dtype, op, n),
                        1,
                        "{dtype} {op} n={n} corrupt"
                    );
                }
            }
        }
    }

    #[test]
    fn alltoall_blocks_come_from_the_right_ranks() {
        let (n, block, dtype) = (3, 5, DataType::I32);
        let sends: Vec<Vec<u8>> = (0..n)
            .map(|r| {
                let mut b = vec![0u8; n * block * 4];
                fill_alltoall(&mut b, dtype, r);
                b
            })
            .collect();
        for r in 0..n {
            let recv: Vec<u8> = (0..n)
                .flat_map(|j| sends[j][r * block * 4..(r + 1) * block * 4].to_vec())
                .collect();
            assert_eq!(check_alltoall(&recv, dtype, r, n), 0);
            let swapped: Vec<u8> = (0..n)
                .rev()
                .flat_map(|j| sends[j][r * block * 4..(r + 1) * block * 4].to_vec())
                .collect();
            assert!(check_alltoall(&swapped, dtype, r, n) > 0);
        }
    }
}
