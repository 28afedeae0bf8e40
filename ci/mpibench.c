/*
 * mpibench: the MPI side of ci/compare.sh. Measures MPI_Allreduce (float,
 * sum) or MPI_Alltoall with collbench's rules, so the two compare directly:
 * same sizes, same iteration counts (1000 up to 64 KiB, 20 up to 64 MiB,
 * fewer above; warmup 100, 5, then 0 as the check warms), time = mean per call, maximum over
 * ranks, busbw = algbw x 2(n-1)/n (allreduce) or (n-1)/n (alltoall), and
 * every result element checked before timing. Prints one line per size:
 *   size count oop_time_us oop_busbw_gbs oop_wrong ip_time_us ip_busbw_gbs ip_wrong
 *
 * mpibench allreduce|alltoall SIZE [SIZE...]   (sizes in bytes)
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, nranks;

/* Rank r's element i: small integers, exact in float whatever the order. */
static float input(int r, size_t i) { return (float)((int)(i % 7) - 3 + r); }

static void iterations(size_t bytes, int *iters, int *warmup) {
    const size_t small = 64u << 10, big = 64u << 20;
    if (bytes <= small) {
        *iters = 1000, *warmup = 100;
    } else if (bytes <= big) {
        *iters = 20, *warmup = 5;
    } else {
        *iters = (int)((20 * big + bytes - 1) / bytes);
        if (*iters < 2) *iters = 2;
        *warmup = 0; /* the check call warms large sizes */
    }
}

static void call(int alltoall, float *send, float *recv, size_t count, int in_place) {
    if (alltoall) {
        int block = (int)(count / nranks);
        MPI_Alltoall(in_place ? MPI_IN_PLACE : send, block, MPI_FLOAT, recv, block, MPI_FLOAT, MPI_COMM_WORLD);
    } else {
        MPI_Allreduce(in_place ? MPI_IN_PLACE : send, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
}

static long check(int alltoall, float *send, float *recv, size_t count, int in_place) {
    float *in = in_place ? recv : send;
    for (size_t i = 0; i < count; i++) in[i] = input(rank, i);
    call(alltoall, send, recv, count, in_place);
    long wrong = 0;
    size_t block = count / nranks;
    for (size_t i = 0; i < count; i++) {
        float want;
        if (alltoall) {
            want = input((int)(i / block), rank * block + i % block);
        } else {
            want = (float)(nranks * ((int)(i % 7) - 3) + nranks * (nranks - 1) / 2);
        }
        wrong += recv[i] != want;
    }
    long total;
    MPI_Allreduce(&wrong, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    return total;
}

static double measure(int alltoall, float *send, float *recv, size_t count, int in_place) {
    int iters, warmup;
    iterations(count * sizeof(float), &iters, &warmup);
    for (int i = 0; i < warmup; i++) call(alltoall, send, recv, count, in_place);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; i++) call(alltoall, send, recv, count, in_place);
    double t = (MPI_Wtime() - t0) / iters, worst;
    MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return worst;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    if (argc < 3 || (strcmp(argv[1], "allreduce") && strcmp(argv[1], "alltoall"))) {
        if (rank == 0) fprintf(stderr, "usage: mpibench allreduce|alltoall SIZE...\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    int alltoall = !strcmp(argv[1], "alltoall");
    double factor = alltoall ? (nranks - 1.0) / nranks : 2.0 * (nranks - 1.0) / nranks;
    size_t max = 0;
    for (int a = 2; a < argc; a++) { size_t b = strtoull(argv[a], 0, 10); if (b > max) max = b; }
    float *send = malloc(max + 64), *recv = malloc(max + 64);
    memset(send, 0, max + 64);
    memset(recv, 0, max + 64);
    long failed = 0;
    for (int a = 2; a < argc; a++) {
        size_t count = strtoull(argv[a], 0, 10) / sizeof(float);
        if (alltoall) count = count / nranks * nranks;
        double t[2];
        long wrong[2];
        for (int ip = 0; ip < 2; ip++) {
            wrong[ip] = check(alltoall, send, recv, count, ip);
            t[ip] = measure(alltoall, send, recv, count, ip);
            failed += wrong[ip];
        }
        double bytes = count * sizeof(float);
        if (rank == 0)
            printf("%zu %zu %.3f %.4f %ld %.3f %.4f %ld\n", (size_t)bytes, count, t[0] * 1e6,
                   bytes / t[0] / 1e9 * factor, wrong[0], t[1] * 1e6, bytes / t[1] / 1e9 * factor, wrong[1]);
        fflush(stdout);
    }
    MPI_Finalize();
    return failed ? 1 : 0;
}
