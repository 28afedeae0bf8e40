//! Reduction operators and their kernels.
//!
//! The kernels are plain loops over typed slices that the compiler vectorises;
//! half-precision types are widened to `f32` in small blocks (F16C converts
//! `f16` when the CPU has it) and rounded back, so they run near memory speed
//! too. `benches/reduce.rs` compares them with `memcpy`.

use std::fmt;
use std::str::FromStr;

use bytemuck::Pod;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::DataType;

/// How elements from different ranks combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    Sum = 1,
    Prod,
    Min,
    Max,
    /// Sum, then divided by the number of ranks (integers truncate).
    Avg,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|o| *o as u8 == v)
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|o| o.name() == s)
            .or(match s.as_str() {
                "product" => Some(ReduceOp::Prod),
                "mean" | "average" => Some(ReduceOp::Avg),
                _ => None,
            })
            .ok_or_else(|| format!("unknown reduction '{s}' (one of sum, prod, min, max, avg)"))
    }
}

/// `dst[i] = dst[i] op src[i]`. Slices are byte views of `dtype` elements,
/// aligned to it and of equal length. For [`ReduceOp::Avg`] this sums; call
/// [`finalize`] once every rank's contribution is in.
pub fn reduce_into(dtype: DataType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "reduce_into: length mismatch");
    match dtype {
        DataType::F32 => native::<f32>(op, cast_mut(dst), cast(src), None),
        DataType::F64 => native::<f64>(op, cast_mut(dst), cast(src), None),
        DataType::F16 => widened::<f16>(op, cast_mut(dst), cast(src), None),
        DataType::Bf16 => widened::<bf16>(op, cast_mut(dst), cast(src), None),
        DataType::I8 => native::<i8>(op, cast_mut(dst), cast(src), None),
        DataType::U8 => native::<u8>(op, cast_mut(dst), cast(src), None),
        DataType::I32 => native::<i32>(op, cast_mut(dst), cast(src), None),
        DataType::U32 => native::<u32>(op, cast_mut(dst), cast(src), None),
        DataType::I64 => native::<i64>(op, cast_mut(dst), cast(src), None),
        DataType::U64 => native::<u64>(op, cast_mut(dst), cast(src), None),
    }
}

/// `dst[i] = a[i] op b[i]`: reduction without first copying `a` into `dst`.
pub fn reduce_to(dtype: DataType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    assert!(
        dst.len() == a.len() && a.len() == b.len(),
        "reduce_to: length mismatch"
    );
    match dtype {
        DataType::F32 => native::<f32>(op, cast_mut(dst), cast(b), Some(cast(a))),
        DataType::F64 => native::<f64>(op, cast_mut(dst), cast(b), Some(cast(a))),
        DataType::F16 => widened::<f16>(op, cast_mut(dst), cast(b), Some(cast(a))),
        DataType::Bf16 => widened::<bf16>(op, cast_mut(dst), cast(b), Some(cast(a))),
        DataType::I8 => native::<i8>(op, cast_mut(dst), cast(b), Some(cast(a))),
        DataType::U8 => native::<u8>(op, cast_mut(dst), cast(b), Some(cast(a))),
        DataType::I32 => native::<i32>(op, cast_mut(dst), cast(b), Some(cast(a))),
        DataType::U32 => native::<u32>(op, cast_mut(dst), cast(b), Some(cast(a))),
        DataType::I64 => native::<i64>(op, cast_mut(dst), cast(b), Some(cast(a))),
        DataType::U64 => native::<u64>(op, cast_mut(dst), cast(b), Some(cast(a))),
    }
}

/// `dst[i] = a[i] op dst[i]`: [`reduce_to`] with `b` already in `dst`.
/// Sum and product are commutative (IEEE addition and multiplication are,
/// bit for bit, but for which NaN's payload survives): one
/// [`reduce_into`] pass. Min and max keep the operand order, whose ties
/// (-0 against +0, NaNs) would differ, in blocks through a buffer on the
/// stack.
pub fn reduce_onto(dtype: DataType, op: ReduceOp, dst: &mut [u8], a: &[u8]) {
    assert_eq!(dst.len(), a.len(), "reduce_onto: length mismatch");
    if matches!(op, ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Prod) {
        return reduce_into(dtype, op, dst, a);
    }
    let mut block = [0u64; 2048];
    let block: &mut [u8] = bytemuck::cast_slice_mut(&mut block);
    for (d, a) in dst.chunks_mut(block.len()).zip(a.chunks(block.len())) {
        let b = &mut block[..d.len()];
        b.copy_from_slice(d);
        reduce_to(dtype, op, d, a, b);
    }
}

/// Completes a reduction over `nranks` contributions: divides for
/// [`ReduceOp::Avg`], nothing for the others.
pub fn finalize(dtype: DataType, op: ReduceOp, buf: &mut [u8], nranks: usize) {
    if op != ReduceOp::Avg || nranks == 1 {
        return;
    }
    let (n, nf) = (nranks as i64, nranks as f32);
    match dtype {
        DataType::F32 => map(cast_mut::<f32>(buf), |x| x / nf),
        DataType::F64 => map(cast_mut::<f64>(buf), |x| x / nranks as f64),
        DataType::F16 => map(cast_mut::<f16>(buf), |x| f16::from_f32(x.to_f32() / nf)),
        DataType::Bf16 => map(cast_mut::<bf16>(buf), |x| {
            bf16_from_f32(bf16_to_f32(x) / nf)
        }),
        DataType::I8 => map(cast_mut::<i8>(buf), |x| (x as i64 / n) as i8),
        DataType::U8 => map(cast_mut::<u8>(buf), |x| (x as i64 / n) as u8),
        DataType::I32 => map(cast_mut::<i32>(buf), |x| (x as i64 / n) as i32),
        DataType::U32 => map(cast_mut::<u32>(buf), |x| (x as i64 / n) as u32),
        DataType::I64 => map(cast_mut::<i64>(buf), |x| x / n),
        DataType::U64 => map(cast_mut::<u64>(buf), |x| x / nranks as u64),
    }
}

/// Types the CPU combines directly. Integers wrap, as in NCCL and MPI.
trait Native: Pod {
    fn add(a: Self, b: Self) -> Self;
    fn mul(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
}

macro_rules! native_int {
    ($($t:ty),*) => {$(
        impl Native for $t {
            fn add(a: Self, b: Self) -> Self { a.wrapping_add(b) }
            fn mul(a: Self, b: Self) -> Self { a.wrapping_mul(b) }
            fn min(a: Self, b: Self) -> Self { Ord::min(a, b) }
            fn max(a: Self, b: Self) -> Self { Ord::max(a, b) }
        }
    )*};
}
native_int!(i8, u8, i32, u32, i64, u64);

macro_rules! native_float {
    ($($t:ty),*) => {$(
        impl Native for $t {
            fn add(a: Self, b: Self) -> Self { a + b }
            fn mul(a: Self, b: Self) -> Self { a * b }
            // Selects rather than f32::min, whose NaN rules stop vectorisation.
            fn min(a: Self, b: Self) -> Self { if b < a { b } else { a } }
            fn max(a: Self, b: Self) -> Self { if b > a { b } else { a } }
        }
    )*};
}
native_float!(f32, f64);

/// `dst = dst op src`, or `dst = a op src` when `a` is given: in 32-byte
/// vectors where the CPU has AVX2 (the baseline build's SSE2 loop did 47
/// GiB/s of f32 sums in cache, half of memcpy's rate).
fn native<T: Native>(op: ReduceOp, dst: &mut [T], src: &[T], a: Option<&[T]>) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { native_avx2(op, dst, src, a) };
    }
    native_loop(op, dst, src, a)
}

/// [`native_loop`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn native_avx2<T: Native>(op: ReduceOp, dst: &mut [T], src: &[T], a: Option<&[T]>) {
    native_loop(op, dst, src, a)
}

#[inline(always)]
fn native_loop<T: Native>(op: ReduceOp, dst: &mut [T], src: &[T], a: Option<&[T]>) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => zip(dst, src, a, T::add),
        ReduceOp::Prod => zip(dst, src, a, T::mul),
        ReduceOp::Min => zip(dst, src, a, T::min),
        ReduceOp::Max => zip(dst, src, a, T::max),
    }
}

#[inline(always)]
fn zip<T: Copy>(dst: &mut [T], src: &[T], a: Option<&[T]>, f: impl Fn(T, T) -> T) {
    match a {
        None => dst.iter_mut().zip(src).for_each(|(d, s)| *d = f(*d, *s)),
        Some(a) => dst
            .iter_mut()
            .zip(a.iter().zip(src))
            .for_each(|(d, (a, s))| *d = f(*a, *s)),
    }
}

/// 16-bit floats: widened to `f32` in blocks, combined, rounded back.
trait Widened: Pod {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// The whole kernel compiled for AVX2 and F16C.
    ///
    /// # Safety
    /// The CPU must have them ([`x86::available`]).
    #[cfg(target_arch = "x86_64")]
    unsafe fn widened_x86(op: ReduceOp, dst: &mut [Self], src: &[Self], a: Option<&[Self]>);
}

impl Widened for f16 {
    // half's slice conversions use F16C when the CPU has it (detected at run time).
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn widened_x86(op: ReduceOp, dst: &mut [Self], src: &[Self], a: Option<&[Self]>) {
        x86::f16_kernel(op, dst, src, a)
    }
}

impl Widened for bf16 {
    // Bit manipulation the compiler vectorises; see bf16_to_f32/bf16_from_f32.
    #[inline(always)]
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = bf16_to_f32(*s))
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = bf16_from_f32(*s))
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn widened_x86(op: ReduceOp, dst: &mut [Self], src: &[Self], a: Option<&[Self]>) {
        x86::bf16_kernel(op, dst, src, a)
    }
}

fn widened<H: Widened>(op: ReduceOp, dst: &mut [H], src: &[H], a: Option<&[H]>) {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: the CPU has the features these versions are compiled for.
        return unsafe { H::widened_x86(op, dst, src, a) };
    }
    widened_with(op, dst, src, a, H::widen, H::narrow)
}

/// The combining loop of the 16-bit types, given their conversions.
#[inline(always)]
fn widened_with<H: Copy>(
    op: ReduceOp,
    dst: &mut [H],
    src: &[H],
    a: Option<&[H]>,
    widen: impl Fn(&[H], &mut [f32]),
    narrow: impl Fn(&[f32], &mut [H]),
) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => widened_zip(dst, src, a, f32::add, widen, narrow),
        ReduceOp::Prod => widened_zip(dst, src, a, f32::mul, widen, narrow),
        ReduceOp::Min => widened_zip(dst, src, a, <f32 as Native>::min, widen, narrow),
        ReduceOp::Max => widened_zip(dst, src, a, <f32 as Native>::max, widen, narrow),
    }
}

#[inline(always)]
fn widened_zip<H: Copy>(
    dst: &mut [H],
    src: &[H],
    a: Option<&[H]>,
    f: impl Fn(f32, f32) -> f32,
    widen: impl Fn(&[H], &mut [f32]),
    narrow: impl Fn(&[f32], &mut [H]),
) {
    // 256 elements: two 1 KiB blocks that stay in L1.
    const BLOCK: usize = 256;
    let (mut x, mut y) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (i, (d, s)) in dst.chunks_mut(BLOCK).zip(src.chunks(BLOCK)).enumerate() {
        let (x, y) = (&mut x[..d.len()], &mut y[..d.len()]);
        match a {
            None => widen(d, x),
            Some(a) => widen(&a[i * BLOCK..i * BLOCK + d.len()], x),
        }
        widen(s, y);
        zip(x, y, None, &f);
        narrow(x, d);
    }
}

/// The 16-bit kernels compiled for AVX2 + F16C, chosen at run time. One
/// fused pass: load 8 elements, widen, combine, round back, store, all in
/// registers. The default x86-64 target (SSE2) has no f16 conversion and
/// narrows bf16 lanes poorly; the block-wise portable path runs 2-5x slower.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::{bf16, f16};

    use super::{widened_with, ReduceOp, Widened};

    pub(super) fn available() -> bool {
        // std caches the CPUID answer; this is two loads after the first call.
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
    }

    /// 8 f16 at `p` as f32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load_f16(p: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }

    /// Two vectors of f32 lanes rounded to nearest even into 16 f16 at `p`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn store_f16(p: *mut f16, v: __m256, w: __m256) {
        _mm_storeu_si128(p.cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v));
        _mm_storeu_si128(
            p.add(8).cast(),
            _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(w),
        );
    }

    /// 8 bf16 at `p` as f32 lanes: each is the top half of an f32.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load_bf16(p: *const bf16) -> __m256 {
        let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
    }

    /// f32 lanes rounded to nearest even to bf16 bits in 32-bit lanes, NaNs
    /// kept quiet: the same bits as `super::bf16_from_f32`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn round_bf16(v: __m256) -> __m256i {
        let bits = _mm256_castps_si256(v);
        let high = _mm256_srli_epi32::<16>(bits);
        let bias = _mm256_add_epi32(
            _mm256_set1_epi32(0x7fff),
            _mm256_and_si256(high, _mm256_set1_epi32(1)),
        );
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, bias));
        let quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
        let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
        _mm256_or_si256(
            _mm256_and_si256(nan, quiet),
            _mm256_andnot_si256(nan, rounded),
        )
    }

    /// Two vectors of f32 lanes rounded into 16 bf16 at `p`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn store_bf16(p: *mut bf16, v: __m256, w: __m256) {
        // packus interleaves the 128-bit halves; the permute restores order.
        let packed = _mm256_packus_epi32(round_bf16(v), round_bf16(w));
        _mm256_storeu_si256(p.cast(), _mm256_permute4x64_epi64::<0b11_01_10_00>(packed));
    }

    macro_rules! fused_kernel {
        ($name:ident, $t:ty, $load:ident, $store:ident) => {
            #[target_feature(enable = "avx2,f16c")]
            pub(super) fn $name(op: ReduceOp, dst: &mut [$t], src: &[$t], a: Option<&[$t]>) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => fused_kernel!(@loop $load, $store, dst, src, a, _mm256_add_ps),
                    ReduceOp::Prod => fused_kernel!(@loop $load, $store, dst, src, a, _mm256_mul_ps),
                    // min_ps(y, x) = y < x ? y : x, the portable min(x, y).
                    ReduceOp::Min => fused_kernel!(@loop $load, $store, dst, src, a, |x, y| _mm256_min_ps(y, x)),
                    ReduceOp::Max => fused_kernel!(@loop $load, $store, dst, src, a, |x, y| _mm256_max_ps(y, x)),
                }
                let done = dst.len() / 16 * 16;
                let tail_a = a.map(|a| &a[done..]);
                widened_with(op, &mut dst[done..], &src[done..], tail_a, <$t>::widen, <$t>::narrow);
            }
        };
        (@loop $load:ident, $store:ident, $dst:ident, $src:ident, $a:ident, $f:expr) => {{
            let n = $dst.len() / 16 * 16;
            let (d, s) = ($dst.as_mut_ptr(), $src.as_ptr());
            let x = $a.map_or(d.cast_const(), |a| a.as_ptr());
            let f = $f;
            for i in (0..n).step_by(16) {
                // SAFETY: i + 16 <= n <= every slice's length (callers assert
                // equal lengths); each lane of dst is read before it is written.
                unsafe {
                    let lo = f($load(x.add(i)), $load(s.add(i)));
                    let hi = f($load(x.add(i + 8)), $load(s.add(i + 8)));
                    $store(d.add(i), lo, hi)
                }
            }
        }};
    }

    fused_kernel!(f16_kernel, f16, load_f16, store_f16);
    fused_kernel!(bf16_kernel, bf16, load_bf16, store_bf16);
}

/// bf16 is the top half of an f32.
#[inline(always)]
pub(crate) fn bf16_to_f32(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// Rounds to nearest even (as `half::bf16::from_f32` does), keeping NaNs quiet.
#[inline(always)]
pub(crate) fn bf16_from_f32(x: f32) -> bf16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) as u16) | 0x0040;
    bf16::from_bits(if x.is_nan() { nan } else { rounded })
}

fn map<T: Copy>(buf: &mut [T], f: impl Fn(T) -> T) {
    buf.iter_mut().for_each(|x| *x = f(*x));
}

fn cast<T: Pod>(b: &[u8]) -> &[T] {
    bytemuck::cast_slice(b)
}

fn cast_mut<T: Pod>(b: &mut [u8]) -> &mut [T] {
    bytemuck::cast_slice_mut(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    #[test]
    fn every_op_on_f32_and_i8() {
        let a = [1.0f32, -2.0, 3.5, 8.0];
        let b = [2.0f32, 5.0, -1.0, 8.0];
        let cases = [
            (ReduceOp::Sum, [3.0f32, 3.0, 2.5, 16.0]),
            (ReduceOp::Prod, [2.0, -10.0, -3.5, 64.0]),
            (ReduceOp::Min, [1.0, -2.0, -1.0, 8.0]),
            (ReduceOp::Max, [2.0, 5.0, 3.5, 8.0]),
        ];
        for (op, want) in cases {
            let mut d = bytes(&a);
            reduce_into(DataType::F32, op, &mut d, &bytes(&b));
            assert_eq!(d, bytes(&want), "{op}");
            let mut d2 = vec![0u8; 16];
            reduce_to(DataType::F32, op, &mut d2, &bytes(&a), &bytes(&b));
            assert_eq!(d2, bytes(&want), "{op} out of place");
        }
        let mut d = bytes(&[100i8, -128, 7]);
        reduce_into(DataType::I8, ReduceOp::Sum, &mut d, &bytes(&[100i8, -1, 7]));
        assert_eq!(d, bytes(&[-56i8, 127, 14]), "integers wrap");
        finalize(DataType::I8, ReduceOp::Avg, &mut d, 2);
        assert_eq!(d, bytes(&[-28i8, 63, 7]));
    }

    #[test]
    fn onto_is_to_with_b_already_in_dst() {
        // Ties that only the operand order settles (-0 against +0, NaN
        // against a number), over more than one of reduce_onto's blocks.
        let n = 5000;
        let a: Vec<f32> = (0..n)
            .map(|i| [0.0, -0.0, f32::NAN, 1.5, -2.0][i % 5])
            .collect();
        let b: Vec<f32> = (0..n)
            .map(|i| [-0.0, 0.0, 3.0, f32::NAN, i as f32][i % 5])
            .collect();
        let to_bf16 = |v: &[f32]| bytes(&v.iter().map(|x| bf16::from_f32(*x)).collect::<Vec<_>>());
        let cases = [
            (DataType::F32, bytes(&a), bytes(&b)),
            (DataType::Bf16, to_bf16(&a), to_bf16(&b)),
        ];
        for (dtype, a, b) in cases {
            for op in ReduceOp::ALL {
                let mut want = vec![0u8; a.len()];
                reduce_to(dtype, op, &mut want, &a, &b);
                let mut got = b.clone();
                reduce_onto(dtype, op, &mut got, &a);
                if matches!(op, ReduceOp::Min | ReduceOp::Max) {
                    assert_eq!(got, want, "{dtype:?} {op}: bit for bit");
                    continue;
                }
                // Sums and products agree bit for bit but for NaN payloads.
                let size = dtype.size();
                let nan = |e: &[u8]| match dtype {
                    DataType::F32 => f32::from_le_bytes(e.try_into().unwrap()).is_nan(),
                    _ => bf16::from_le_bytes(e.try_into().unwrap()).is_nan(),
                };
                for (g, w) in got.chunks(size).zip(want.chunks(size)) {
                    assert!(g == w || (nan(g) && nan(w)), "{dtype:?} {op}: {g:?} {w:?}");
                }
            }
        }
    }

    #[test]
    fn half_types_round_like_the_half_crate() {
        // Odd length crosses a block boundary; values exercise rounding.
        let n = 1000;
        let xs: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 300.0).collect();
        let ys: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 7.0).collect();
        for op in ReduceOp::ALL {
            let f = |a: f32, b: f32| match op {
                ReduceOp::Sum | ReduceOp::Avg => a + b,
                ReduceOp::Prod => a * b,
                ReduceOp::Min => a.min(b),
                ReduceOp::Max => a.max(b),
            };
            let (a16, b16): (Vec<f16>, Vec<f16>) = xs
                .iter()
                .zip(&ys)
                .map(|(x, y)| (f16::from_f32(*x), f16::from_f32(*y)))
                .unzip();
            let want: Vec<f16> = a16
                .iter()
                .zip(&b16)
                .map(|(a, b)| f16::from_f32(f(a.to_f32(), b.to_f32())))
                .collect();
            let mut d = bytes(&a16);
            reduce_into(DataType::F16, op, &mut d, &bytes(&b16));
            assert_eq!(d, bytes(&want), "f16 {op}");

            let (a, b): (Vec<bf16>, Vec<bf16>) = xs
                .iter()
                .zip(&ys)
                .map(|(x, y)| (bf16::from_f32(*x), bf16::from_f32(*y)))
                .unzip();
            let want: Vec<bf16> = a
                .iter()
                .zip(&b)
                .map(|(a, b)| bf16::from_f32(f(a.to_f32(), b.to_f32())))
                .collect();
            let mut d = vec![0u8; 2 * n];
            reduce_to(DataType::Bf16, op, &mut d, &bytes(&a), &bytes(&b));
            assert_eq!(d, bytes(&want), "bf16 {op}");
        }
    }

    /// The run-time-dispatched kernels and the portable ones give the same bits.
    #[test]
    fn portable_and_dispatched_half_kernels_agree() {
        let n = 777;
        let a: Vec<f16> = (0..n)
            .map(|i| f16::from_f32((i as f32 * 0.731).sin() * 100.0))
            .collect();
        let b: Vec<f16> = (0..n)
            .map(|i| f16::from_f32((i as f32 * 0.17).cos()))
            .collect();
        let (ab, bb): (Vec<bf16>, Vec<bf16>) = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (bf16::from_f32(x.to_f32()), bf16::from_f32(y.to_f32())))
            .unzip();
        for op in ReduceOp::ALL {
            let (mut d1, mut d2) = (a.clone(), a.clone());
            widened(op, &mut d1, &b, None);
            widened_with(op, &mut d2, &b, None, f16::widen, f16::narrow);
            assert_eq!(bytes(&d1), bytes(&d2), "f16 {op}");
            let (mut d1, mut d2) = (ab.clone(), ab.clone());
            widened(op, &mut d1, &bb, Some(&ab));
            widened_with(op, &mut d2, &bb, Some(&ab), bf16::widen, bf16::narrow);
            assert_eq!(bytes(&d1), bytes(&d2), "bf16 {op}");
        }
    }

    #[test]
    fn bf16_conversion_matches_half_everywhere_that_matters() {
        for bits in (0..=u32::MAX).step_by(65_521) {
            let x = f32::from_bits(bits);
            let ours = bf16_from_f32(x);
            let theirs = bf16::from_f32(x);
            if x.is_nan() {
                assert!(ours.is_nan());
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{x:e}");
            }
        }
    }
}
