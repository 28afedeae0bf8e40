/*
 * How long one cache line takes to go between two cores and back: two
 * threads pinned to CPUs 0 and 1 take turns writing a counter the other
 * waits for. On the 2-core CI VM this is bimodal (about 50 or 105 ns per
 * round trip, a process or a minute at a time), and every small-call figure
 * of ours follows it; run it beside a comparison to know which mode the
 * machine was in.
 *
 *   gcc -O2 -pthread -o linepingpong ci/linepingpong.c && ./linepingpong [rounds]
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cpu.h"

static _Alignas(64) _Atomic uint32_t ping;
static _Alignas(64) _Atomic uint32_t pong;
static uint32_t rounds = 1000000;

static void *answer(void *unused) {
    (void)unused;
    pin(1);
    for (uint32_t k = 1; k <= rounds; k++) {
        while (atomic_load_explicit(&ping, memory_order_acquire) != k) {}
        atomic_store_explicit(&pong, k, memory_order_release);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1) rounds = (uint32_t)strtoul(argv[1], NULL, 10);
    pthread_t other;
    pthread_create(&other, NULL, answer, NULL);
    pin(0);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (uint32_t k = 1; k <= rounds; k++) {
        atomic_store_explicit(&ping, k, memory_order_release);
        while (atomic_load_explicit(&pong, memory_order_acquire) != k) {}
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    pthread_join(other, NULL);
    double ns = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
    printf("cache line round trip between CPUs 0 and 1: %.1f ns\n", ns / rounds);
    return 0;
}
