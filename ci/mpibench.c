/*
 * mpibench: the MPI side of ci/compare.sh. Measures MPI_Allreduce (float,
 * sum), MPI_Alltoall, MPI_Reduce_scatter_block, MPI_Allgather, MPI_Bcast or
 * MPI_Reduce (root 0) with collbench's rules, so the two compare directly:
 * same sizes, same iteration counts (up to 64 MiB as many as fill 50 ms,
 * at least 1000 up to 64 KiB and 20 above; fewer above 64 MiB; warmup 100,
 * 5, then 0 as the check warms), time = mean per call, maximum over
 * ranks, busbw = algbw x 2(n-1)/n (allreduce), (n-1)/n (alltoall,
 * reducescatter, allgather) or 1 (broadcast, reduce), and
 * every result element checked before timing. Prints one line per size:
 *   size count oop_time_us oop_busbw_gbs oop_wrong ip_time_us ip_busbw_gbs ip_wrong
 *
 * mpibench [--fresh] COLLECTIVE SIZE [SIZE...]   (sizes in bytes; --fresh:
 * as collbench's, every input line stored to before each call)
 */
#include <mpi.h>
#include <stdint.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static int rank, nranks;

/* A zeroed buffer of `bytes` on the memory collbench's buffers get
 * (collectives `HugeBuffer`): one of a huge page or more starts on a huge-page
 * boundary and is advised, whole, into transparent huge pages before the
 * first touch, so that both libraries read and write the same kind of pages
 * (4 KiB ones cost a single-copy read a page walk per 4 KiB) wherever malloc
 * would have put them. */
static void *buffer(size_t bytes) {
    const size_t huge = 2u << 20;
    if (bytes < huge) {
        char *p = calloc(1, bytes ? bytes : 1);
        if (!p) { perror("calloc"); MPI_Abort(MPI_COMM_WORLD, 2); }
        return p;
    }
    size_t len = (bytes + huge - 1) / huge * huge;
    void *p = NULL;
    if (posix_memalign(&p, huge, len)) { perror("posix_memalign"); MPI_Abort(MPI_COMM_WORLD, 2); }
    madvise(p, len, MADV_HUGEPAGE);
    memset(p, 0, len);
    return p;
}

/* Rank r's element i: small integers, exact in float whatever the order. */
static float input(int r, size_t i) { return (float)((int)(i % 7) - 3 + r); }

/* Up to 64 MiB, as many timed calls as fill 50 ms at the warm-up's pace
 * (the slowest rank's), from `iterations`' count up to a million up to 64
 * KiB, to 1000 above (collbench's rule). */
static const size_t small = 64u << 10, big = 64u << 20;

static int paced(size_t bytes, int iters, double pace) {
    if (bytes > big || pace <= 0) return iters;
    double want = ceil(0.05 / pace), most = bytes <= small ? 1000000 : 1000;
    if (want > most) want = most;
    return want < iters ? iters : (int)want;
}

static void iterations(size_t bytes, int *iters, int *warmup) {
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

enum coll { ALLREDUCE, ALLTOALL, REDUCESCATTER, ALLGATHER, BROADCAST, REDUCE };
static const char *names[] = {"allreduce", "alltoall", "reducescatter", "allgather", "broadcast", "reduce"};

/* --fresh: every cache line of the call's input stored to (same value)
 * before the call, as collbench --fresh does. */
static int fresh;
static void rewrite(float *p, size_t floats) {
    volatile char *b = (volatile char *)p;
    for (size_t i = 0; i < floats * sizeof(float); i += 64) b[i] = b[i];
}

/* collbench's sizes: `count` is the larger buffer's (the input of
 * reducescatter, the output of allgather); root 0; in place, the data
 * starts and ends in `recv` (MPI_IN_PLACE). MPI_Bcast has one buffer: out
 * of place, the root copies `send` into `recv` first (memcpy), as an MPI
 * program must to end with collbench's out-of-place result. */
static void call(enum coll c, float *send, float *recv, size_t count, int in_place) {
    int block = (int)(count / nranks), n = (int)count;
    if (fresh) {
        if (in_place || (c == BROADCAST && rank != 0)) rewrite(recv, count);
        else rewrite(send, c == ALLGATHER ? count / nranks : count);
    }
    void *in = in_place ? MPI_IN_PLACE : send;
    switch (c) {
    case ALLREDUCE: MPI_Allreduce(in, recv, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); break;
    case ALLTOALL: MPI_Alltoall(in, block, MPI_FLOAT, recv, block, MPI_FLOAT, MPI_COMM_WORLD); break;
    case REDUCESCATTER: MPI_Reduce_scatter_block(in, recv, block, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); break;
    case ALLGATHER: MPI_Allgather(in, block, MPI_FLOAT, recv, block, MPI_FLOAT, MPI_COMM_WORLD); break;
    case BROADCAST:
        if (!in_place && rank == 0) memcpy(recv, send, count * sizeof(float));
        MPI_Bcast(recv, n, MPI_FLOAT, 0, MPI_COMM_WORLD);
        break;
    case REDUCE:
        MPI_Reduce(in_place && rank != 0 ? recv : in, recv, n, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD);
        break;
    }
}

/* The sum over ranks of input(r, i). */
static float sum(size_t i) { return (float)(nranks * ((int)(i % 7) - 3) + nranks * (nranks - 1) / 2); }

static long check(enum coll c, float *send, float *recv, size_t count, int in_place) {
    size_t block = count / nranks, len = count;
    float *in = in_place ? recv : send;
    memset(recv, 0, count * sizeof(float));
    if (c == ALLGATHER) {
        /* In place, this rank's block already sits at its place in the output. */
        float *own = in_place ? recv + rank * block : send;
        for (size_t i = 0; i < block; i++) own[i] = input(rank, i);
    } else if (c == BROADCAST) {
        for (size_t i = 0; rank == 0 && i < count; i++) in[i] = input(0, i);
    } else {
        for (size_t i = 0; i < count; i++) in[i] = input(rank, i);
    }
    call(c, send, recv, count, in_place);
    if (c == REDUCESCATTER) len = block;
    if (c == REDUCE && rank != 0) len = 0;
    long wrong = 0;
    for (size_t i = 0; i < len; i++) {
        float want;
        switch (c) {
        case ALLTOALL: want = input((int)(i / block), rank * block + i % block); break;
        case REDUCESCATTER: want = sum(rank * block + i); break;
        case ALLGATHER: want = input((int)(i / block), i % block); break;
        case BROADCAST: want = input(0, i); break;
        default: want = sum(i); break;
        }
        wrong += recv[i] != want;
    }
    long total;
    MPI_Allreduce(&wrong, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    return total;
}

static double measure(enum coll c, float *send, float *recv, size_t count, int in_place) {
    int iters, warmup;
    iterations(count * sizeof(float), &iters, &warmup);
    double w0 = MPI_Wtime(), pace;
    for (int i = 0; i < warmup; i++) call(c, send, recv, count, in_place);
    double mine = (MPI_Wtime() - w0) / (warmup ? warmup : 1);
    MPI_Allreduce(&mine, &pace, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    iters = paced(count * sizeof(float), iters, pace);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; i++) call(c, send, recv, count, in_place);
    double t = (MPI_Wtime() - t0) / iters, worst;
    MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return worst;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    if (argc > 1 && !strcmp(argv[1], "--fresh")) fresh = 1, argv++, argc--;
    int c = -1;
    for (int k = 0; argc >= 3 && k < 6; k++)
        if (!strcmp(argv[1], names[k])) c = k;
    if (c < 0) {
        if (rank == 0) fprintf(stderr, "usage: mpibench [--fresh] allreduce|alltoall|reducescatter|allgather|broadcast|reduce SIZE...\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    double factor = c == ALLREDUCE ? 2.0 * (nranks - 1.0) / nranks
                  : c == BROADCAST || c == REDUCE ? 1.0 : (nranks - 1.0) / nranks;
    size_t max = 0;
    for (int a = 2; a < argc; a++) { size_t b = strtoull(argv[a], 0, 10); if (b > max) max = b; }
    float *send = buffer(max + 64), *recv = buffer(max + 64);
    long failed = 0;
    for (int a = 2; a < argc; a++) {
        size_t count = strtoull(argv[a], 0, 10) / sizeof(float);
        if (c == ALLTOALL || c == REDUCESCATTER || c == ALLGATHER) count = count / nranks * nranks;
        double t[2];
        long wrong[2];
        for (int ip = 0; ip < 2; ip++) {
            wrong[ip] = check(c, send, recv, count, ip);
            t[ip] = measure(c, send, recv, count, ip);
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
