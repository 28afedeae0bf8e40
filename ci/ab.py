#!/usr/bin/env python3
"""Two (or more) builds of collbench side by side: A/B for a change.

    python3 ci/ab.py COLLECTIVE RANKS SIZE ROUNDS BIN_A BIN_B [BIN ...] [--iters N] [--fresh] [--tcp] [--ip] [--huge] [--busy] [--each]

Runs each binary in turn, ROUNDS times (the order reversed every other
round), at one size, and prints per binary the median time per call (out of
place; --ip: in place), its quartiles and the median of the per-round ratios to BIN_A. This
machine's speed drifts by 1.5-2x from minute to minute (see
ci/linepingpong.c); runs next to each other in time see the same drift, so
the paired ratio says more than two medians taken apart. A BIN named "mpi"
runs Open MPI (ci/mpibench.c built as target/compare/mpibench, as
ci/compare.sh builds it). Copy each build aside first (cp
target/release/collbench /tmp/cb-a), then rebuild. --fresh: every binary,
Open MPI's too, rewrites each call's input before the call (collbench
--fresh). --tcp: every binary over TCP on loopback (ours COLL_TRANSPORT=tcp,
Open MPI's btl tcp on lo). A BIN may carry COLL_* settings before the path
(COLL_CHUNK=256K:/tmp/cb-a; COLL_SHARED_BUFFERS=1:/tmp/cb-a for
collbench --shared-buffers); BUSY=1 (BUSY=1:mpi too) runs that binary
beside a busy loop (as --busy, which would add a second one), so that one
series has a build idle and busy in the same minutes: the goal's "busy
within 3x of idle". SIZE takes K, M and G suffixes for every binary.
--huge: every binary also runs a 16 MiB size after SIZE, so that its
buffers are sized, and advised into transparent huge pages, as in a sweep
up to 16 MiB (ci/compare.sh's): buffers below 2 MiB get no huge pages, so a
run of 1 MiB alone reads 4 KiB pages, on which each single-copy read walks
and pins a page per 4 KiB, and measures up to 4x slower than the same size
in such a sweep (8-rank Broadcast of 1 MiB: 470-560 us against 100-130).
--busy: a busy loop pinned to the last core runs throughout, for every
binary (as ci/compare.sh --busy): a core shared with other work.
--each: also prints every round: the cache-line round trip between the
first two cores just before it (ci/linepingpong.c, built by
ci/compare.sh as target/compare/linepingpong), each binary's time and
its ratio to BIN_A's. This VM has minutes when a line takes ~500 ns
between the cores instead of ~100, and small calls are bimodal within
either (2-rank 8 B Broadcast: 0.08 or 0.13-0.19 us a call, Open MPI's
too): a median over rounds of both kinds says less than the rounds.
"""
import contextlib
import json
import os
import statistics
import subprocess
import sys


def in_bytes(size):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return str(int(size[:-1]) * units[size[-1]]) if size[-1] in units else size


HUGE = "16M"


def run(binary, *args):
    """`binary`'s time per call: its settings (KEY=VALUE: before the path,
    BUSY=1 for a busy loop beside it) split off once, the rest as
    `run_one`'s environment."""
    *settings, path = binary.split(":")
    settings = dict(s.split("=", 1) for s in settings)
    with busy_loop(settings.pop("BUSY", None) == "1"):
        return run_one(path, settings, *args)


def run_one(binary, settings, coll, ranks, size, iters, fresh, tcp, ip, huge):
    # The size asked for comes first: its row is the first of the output.
    sizes = [size] + [HUGE] * (huge and int(in_bytes(size)) < int(in_bytes(HUGE)))
    if binary == "mpi":
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1")
        btl = ["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"] * tcp
        out = subprocess.run(["mpirun.openmpi", "-n", ranks] + btl + ["target/compare/mpibench"]
                             + ["--fresh"] * fresh + [coll] + [in_bytes(s) for s in sizes],
                             capture_output=True, text=True, env=env, check=True).stdout
        row = next(line.split() for line in out.splitlines() if line[:1].isdigit())
        return float(row[5 if ip else 2])
    env = dict(os.environ, **settings)
    if tcp:
        env["COLL_TRANSPORT"] = "tcp"
    cmd = [binary, coll, "-n", ranks, "--size", ",".join(sizes), "--json", "-"]
    if iters:
        cmd += ["--iters", iters]
    if fresh:
        cmd.append("--fresh")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out)["rows"][0]["in_place" if ip else "out_of_place"]["time_us"]


def paired_runs(bins, rounds, *args, each=False):
    """Each binary's time per call (`run(b, *args)`) in `rounds` rounds, the
    order reversed every other round: {binary: [time per round]}."""
    times = {b: [] for b in bins}
    for r in range(rounds):
        trip = round_trip() if each else None
        for b in bins if r % 2 == 0 else bins[::-1]:
            times[b].append(run(b, *args))
        if each:
            row = [times[b][-1] for b in bins]
            print(f"round {r + 1:2d}  line {trip or '?':>6} ns  "
                  + "  ".join(f"{t:10.3f}" for t in row) + "   x BIN_A "
                  + "  ".join(f"{t / row[0]:.2f}" for t in row[1:]), flush=True)
    return times


def round_trip():
    """The cache-line round trip between the first two cores now, in ns
    (None without ci/compare.sh's build of ci/linepingpong.c)."""
    try:
        out = subprocess.run(["target/compare/linepingpong", "100000"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{float(out.split()[-2]):.0f}"


@contextlib.contextmanager
def busy_loop(on):
    """A shell busy loop pinned to the last core while the block runs."""
    if not on:
        yield
        return
    core = str(os.cpu_count() - 1)
    hog = subprocess.Popen(["taskset", "-c", core, "sh", "-c", "while :; do :; done"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def main():
    args = sys.argv[1:]
    iters = None
    if "--iters" in args:
        at = args.index("--iters")
        iters = args[at + 1]
        del args[at:at + 2]
    fresh = "--fresh" in args
    if fresh:
        args.remove("--fresh")
    tcp = "--tcp" in args
    if tcp:
        args.remove("--tcp")
    ip = "--ip" in args
    if ip:
        args.remove("--ip")
    huge = "--huge" in args
    if huge:
        args.remove("--huge")
    busy = "--busy" in args
    if busy:
        args.remove("--busy")
    each = "--each" in args
    if each:
        args.remove("--each")
    if len(args) < 6:
        sys.exit(__doc__)
    coll, ranks, size, rounds, bins = args[0], args[1], args[2], int(args[3]), args[4:]
    with busy_loop(busy):
        times = paired_runs(bins, rounds, coll, ranks, size, iters, fresh, tcp, ip, huge,
                            each=each)
    base = times[bins[0]]
    for b in bins:
        t = times[b]
        q = statistics.quantiles(t, n=4) if len(t) > 1 else [t[0]] * 3
        ratio = statistics.median(x / y for x, y in zip(t, base))
        print(f"{coll} {ranks} ranks {size} B  {b:24s} median {statistics.median(t):.3f} us "
              f"(q1 {q[0]:.3f}, q3 {q[2]:.3f})  paired ratio to {bins[0]}: {ratio:.3f}")


if __name__ == "__main__":
    main()
