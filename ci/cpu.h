/*
 * What the measuring programs in ci/ share: pinning the calling thread (or
 * a single-threaded process) to a core, and a monotonic clock.
 */
#ifndef CI_CPU_H
#define CI_CPU_H

#include <sched.h>
#include <time.h>

/* Pins the calling thread to `cpu` (pid 0: the caller's thread on Linux). */
static inline void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof set, &set);
}

/* Microseconds on the monotonic clock. */
static inline double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

#endif
