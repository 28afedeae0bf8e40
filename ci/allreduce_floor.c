/*
 * How fast could a 2-rank in-place AllReduce (f32 sum) be on this machine?
 * Two threads, one per core, stand for the two ranks, with no message, no
 * doorbell and no executor between them. Pipelined in chunks, as ours is:
 * thread t reduces half t chunk by chunk into its own buffer (own +=
 * peer's), flags each chunk, and copies the other half's chunks from its
 * peer as the peer flags them. Each way reads the peer's data differently:
 *
 *   direct   reduces straight from the peer's buffer, as if its memory were
 *            mapped (XPMEM): the floor for any two processes;
 *   staged   copies each peer chunk into a private buffer first (memcpy)
 *            and reduces from there;
 *   pieces   the same, 256 KiB at a time;
 *   cma      staged, and the second half's copies, with process_vm_readv
 *            (on our own pid: the kernel pins and copies as it would for a
 *            peer's), as ours reads;
 *   cma-pcs  the same, 256 KiB at a time (as ours since 0a4dccd);
 *   cma-slot the same, each piece at its own offset in a whole-chunk
 *            buffer, as ours reads into a 1 MiB staging slot.
 *
 * Buffers are on transparent huge pages, as collbench's and our staging.
 * On the Intel Xeon VM (docs/measurements.md), 16 MiB: direct 1136-1180 us,
 * staged 1396, pieces 1156-1162, cma 1468-1525, cma-pcs 1267-1279; built
 * for AVX2 only (-mavx2, as our reduction kernels), cma-pcs 1332. Another
 * day: cma-pcs 1370-1375, cma-slot 1513-1619 (the 1 MiB buffer's lines
 * leave the L2 between chunks; `transfers::CACHED_CHUNK`).
 *
 *   gcc -O3 -march=native -pthread -o allreduce_floor ci/allreduce_floor.c
 *   ./allreduce_floor [bytes=16M] [chunk=1M] [calls=300]
 *
 * Prints the median and quartiles of a call's time, microseconds, for each
 * way. Compare with `collbench allreduce -n 2 -b 16M -e 16M -c 0` and
 * Open MPI's in-place MPI_Allreduce run side by side (ci/ab.py).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu.h"

static size_t bytes = 16 << 20, chunk = 1 << 20, piece;
static int calls = 300, staged, cma, whole_slot;
static float *buf[2];
static _Atomic long done[2][4096]; /* the call in which a chunk was reduced */
static pthread_barrier_t start;
static double took[2][100000];

static size_t parse(const char *s) {
    char *end;
    size_t v = strtoull(s, &end, 10);
    if (*end == 'K' || *end == 'k') v <<= 10;
    if (*end == 'M' || *end == 'm') v <<= 20;
    return v;
}

/* On transparent huge pages, as collbench's buffers and our staging are:
 * process_vm_readv then pins one page per 2 MiB. */
static void *huge(size_t len) {
    size_t whole = (len + (2 << 20) - 1) & ~(size_t)((2 << 20) - 1);
    void *p = aligned_alloc(2 << 20, whole);
    madvise(p, whole, MADV_HUGEPAGE);
    return p;
}

static void *rank(void *arg) {
    int me = (int)(long)arg, peer = 1 - me;
    pin(me);
    size_t half = bytes / 2, n_chunks = half / chunk;
    float *own = buf[me], *theirs = buf[peer];
    float *stage = huge(chunk);
    memset(stage, 0, chunk);
    for (int call = 1; call <= calls; call++) {
        pthread_barrier_wait(&start);
        double t0 = now_us();
        size_t mine = me * half, other = peer * half;
        for (size_t c = 0; c < n_chunks; c++) {
            float *dst = own + (mine + c * chunk) / 4;
            const float *src = theirs + (mine + c * chunk) / 4;
            for (size_t p = 0; p < chunk; p += piece) {
                const float *from = src + p / 4;
                float *to = dst + p / 4;
                if (staged) {
                    if (cma) {
                        float *at = whole_slot ? stage + p / 4 : stage;
                        struct iovec l = {at, piece}, r = {(void *)from, piece};
                        if (process_vm_readv(getpid(), &l, 1, &r, 1, 0) != (ssize_t)piece) abort();
                        from = at;
                    } else {
                        memcpy(stage, from, piece);
                        from = stage;
                    }
                }
                for (size_t i = 0; i < piece / 4; i++) to[i] += from[i];
            }
            atomic_store_explicit(&done[me][c], call, memory_order_release);
        }
        for (size_t c = 0; c < n_chunks; c++) {
            while (atomic_load_explicit(&done[peer][c], memory_order_acquire) < call)
                ;
            char *to = (char *)own + other + c * chunk, *from = (char *)theirs + other + c * chunk;
            if (cma) {
                struct iovec l = {to, chunk}, r = {from, chunk};
                if (process_vm_readv(getpid(), &l, 1, &r, 1, 0) != (ssize_t)chunk) abort();
            } else {
                memcpy(to, from, chunk);
            }
        }
        took[me][call - 1] = now_us() - t0;
    }
    free(stage);
    return NULL;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void run(const char *name) {
    pthread_t t[2];
    for (int r = 0; r < 2; r++)
        for (size_t c = 0; c < 4096; c++) atomic_store(&done[r][c], 0);
    for (long r = 0; r < 2; r++) pthread_create(&t[r], NULL, rank, (void *)r);
    for (int r = 0; r < 2; r++) pthread_join(t[r], NULL);
    double slow[100000];
    for (int c = 0; c < calls; c++) slow[c] = took[0][c] > took[1][c] ? took[0][c] : took[1][c];
    int warm = calls / 10;
    qsort(slow + warm, calls - warm, sizeof(double), cmp);
    int n = calls - warm;
    printf("%-8s %zu bytes, %zu-byte chunks: median %.0f us (quartiles %.0f-%.0f), %.2f GB/s busbw\n",
           name, bytes, chunk, slow[warm + n / 2], slow[warm + n / 4], slow[warm + 3 * n / 4],
           bytes / slow[warm + n / 2] / 1e3);
}

int main(int argc, char **argv) {
    if (argc > 1) bytes = parse(argv[1]);
    if (argc > 2) chunk = parse(argv[2]);
    if (argc > 3) calls = atoi(argv[3]);
    if (bytes % (2 * chunk) || bytes / 2 / chunk > 4096 || calls < 10 || calls > 100000) {
        fprintf(stderr, "bytes must be a multiple of 2 chunks, at most 8192 chunks; 10-100000 calls\n");
        return 2;
    }
    for (int r = 0; r < 2; r++) {
        buf[r] = huge(bytes);
        for (size_t i = 0; i < bytes / 4; i++) buf[r][i] = 0.0f; /* sums stay finite */
    }
    pthread_barrier_init(&start, NULL, 2);
    staged = 0;
    piece = chunk;
    run("direct");
    staged = 1;
    piece = chunk;
    run("staged");
    piece = chunk < (256 << 10) ? chunk : 256 << 10;
    run("pieces");
    cma = 1;
    piece = chunk;
    run("cma");
    piece = chunk < (256 << 10) ? chunk : 256 << 10;
    run("cma-pcs");
    whole_slot = 1;
    run("cma-slot");
    return 0;
}
