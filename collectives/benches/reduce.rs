//! Reduction kernels against memcpy, at a cache-resident size (256 KiB, the
//! size of a chunk the executor reduces while it is hot) and a memory-bound
//! one (64 MiB). Throughput counts the bytes of the destination.
//!
//! cargo bench -p collectives --bench reduce

use collectives::call::reduce::{reduce_into, reduce_to};
use collectives::{DataType, ReduceOp};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

fn kernels(c: &mut Criterion) {
    for bytes in [256 << 10, 64 << 20] {
        let mut g = c.benchmark_group(format!("reduce/{}KiB", bytes >> 10));
        g.throughput(Throughput::Bytes(bytes as u64));
        if bytes > 1 << 20 {
            g.sample_size(20);
        }
        let a = vec![1u8; bytes];
        let b = vec![2u8; bytes];
        let mut dst = vec![0u8; bytes];
        // The yardstick: what moving the bytes costs at all.
        g.bench_function("memcpy", |bench| bench.iter(|| dst.copy_from_slice(&a)));
        for dtype in [
            DataType::F32,
            DataType::Bf16,
            DataType::F16,
            DataType::F64,
            DataType::I32,
            DataType::I8,
        ] {
            g.bench_with_input(BenchmarkId::new("sum_into", dtype), &dtype, |bench, &d| {
                bench.iter(|| reduce_into(d, ReduceOp::Sum, &mut dst, &b))
            });
        }
        for dtype in [DataType::F32, DataType::Bf16, DataType::F16] {
            g.bench_with_input(BenchmarkId::new("sum_to", dtype), &dtype, |bench, &d| {
                bench.iter(|| reduce_to(d, ReduceOp::Sum, &mut dst, &a, &b))
            });
        }
        g.bench_function("max_into/f32", |bench| {
            bench.iter(|| reduce_into(DataType::F32, ReduceOp::Max, &mut dst, &b))
        });
        g.finish();
    }
}

criterion_group!(benches, kernels);
criterion_main!(benches);
