/*
 * What copying over lines another core has just read costs, with plain
 * stores (memcpy) and with streaming ones: as an in-place AllToAll's staged
 * block lands on the block its peer has just read (collectives/src/
 * stream_copy.rs, copy_staged). A thread on CPU 1 reads the destination,
 * then the thread on CPU 0 copies 1 MiB over it; the same with no reader,
 * for comparison. Run it beside ci/linepingpong.c: on the AMD VM the gap
 * grows when lines move slowly between the cores.
 *
 *   gcc -O2 -pthread -o copyover ci/copyover.c && ./copyover
 */
#define _GNU_SOURCE
#include <emmintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu.h"

#define BYTES (1 << 20)
#define CALLS 2000

static char *src, *dst;
static _Atomic int turn; /* 1: the reader's turn, 0: the copier's, -1: stop */
static volatile long sink;

static void *reader(void *arg) {
    (void)arg;
    pin(1);
    for (;;) {
        int t;
        while ((t = atomic_load(&turn)) == 0) {
        }
        if (t < 0)
            return NULL;
        long sum = 0;
        for (size_t i = 0; i < BYTES; i += 64)
            sum += dst[i];
        sink = sum;
        atomic_store(&turn, 0);
    }
}

static void stream(char *d, const char *s, size_t n) {
    for (size_t i = 0; i < n; i += 16)
        _mm_stream_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(s + i)));
    _mm_sfence();
}

/* Microseconds per copy, the destination read by CPU 1 before each if `read`. */
static double measure(int streaming, int read) {
    double total = 0;
    for (int k = 0; k < CALLS; k++) {
        if (read) {
            atomic_store(&turn, 1);
            while (atomic_load(&turn) != 0) {
            }
        }
        double t = now_us();
        if (streaming)
            stream(dst, src, BYTES);
        else
            memcpy(dst, src, BYTES);
        total += now_us() - t;
    }
    return total / CALLS;
}

int main(void) {
    src = aligned_alloc(4096, BYTES);
    dst = aligned_alloc(4096, BYTES);
    memset(src, 1, BYTES);
    memset(dst, 2, BYTES);
    pin(0);
    pthread_t t;
    pthread_create(&t, NULL, reader, NULL);
    for (int read = 0; read < 2; read++)
        printf("1 MiB over lines %s: memcpy %.1f us, streaming %.1f us\n",
               read ? "CPU 1 just read" : "no other core read", measure(0, read),
               measure(1, read));
    atomic_store(&turn, -1);
    pthread_join(t, NULL);
    return 0;
}
