#!/usr/bin/env python3
"""Reads the raw results ci/compare.sh collected and prints one table:
per collective, rank count and size, our median busbw (or time, at sizes
where time is what matters), Open MPI's and Gloo's, and the ratios: the
median of the repetitions' ratios, each between runs made one after the
other (the machine's speed drifts between repetitions, see ci/ab.py).

    compare_table.py RESULTS_DIR [IDLE_RESULTS_DIR]
    compare_table.py RESULTS_DIR --reps COLLECTIVE RANKS SIZE
    compare_table.py RESULTS_DIR --recheck ROUNDS [--fresh]

With a second directory (an idle run's, RESULTS_DIR being a `--busy` one),
each row also gets how many times slower than idle ours and Open MPI's
medians are, a row over issue 11's limit of 3x marked `!`.

--reps: one cell, repetition by repetition (time per call, both modes, and
the cache-line round trip as the repetition began): whether a low median
is one slow minute or every repetition (SIZE in bytes, or K/M/G).

--recheck: every cell below 1.0 against Open MPI, run again in ROUNDS
pairs of runs side by side (ci/ab.py's), from the repository's root with
target/release/collbench and target/compare/mpibench as ci/compare.sh
leaves them: whether the cell is behind in paired runs too, or only in the
sweep's minute. ci/compare.sh --recheck runs it while the sweep's
conditions (its busy loop) still hold.
"""
import glob
import json
import os
import statistics
import sys
from collections import defaultdict

from ab import in_bytes, paired_runs  # ci/ab.py's sizes and side-by-side runs

LATENCY_BYTES = 64  # below this, compare time, not bandwidth


def human(b):
    for unit in ["B", "KiB", "MiB", "GiB"]:
        if b < 1024 or unit == "GiB":
            return f"{b:g} {unit}" if b == int(b) else f"{b:.1f} {unit}"
        b /= 1024


def load(d):
    """res[(coll, n, size, impl, mode)] = {rep: (time_us, busbw, wrong)}"""
    res = defaultdict(dict)
    for path in glob.glob(os.path.join(d, "ours-*.json")):
        _, coll, n, rep = os.path.basename(path)[:-5].split("-")
        doc = json.load(open(path))
        for r in doc["rows"]:
            for mode in ["out_of_place", "in_place"]:
                m = r[mode]
                res[(coll, int(n), r["bytes"], "ours", mode)][rep] = (m["time_us"], m["busbw_gbs"], m["wrong"])
    for path in glob.glob(os.path.join(d, "mpi-*.txt")) + glob.glob(os.path.join(d, "gloo-*.txt")):
        impl, coll, n, rep = os.path.basename(path)[:-4].split("-")
        for line in open(path):
            f = line.split()
            if len(f) == 8 and impl == "mpi":
                size = int(f[0])
                res[(coll, int(n), size, "mpi", "out_of_place")][rep] = (float(f[2]), float(f[3]), int(f[4]))
                res[(coll, int(n), size, "mpi", "in_place")][rep] = (float(f[5]), float(f[6]), int(f[7]))
            elif len(f) == 5 and impl == "gloo":
                mode = "in_place" if coll == "allreduce" else "out_of_place"
                res[(coll, int(n), int(f[0]), "gloo", mode)][rep] = (float(f[2]), float(f[3]), int(f[4]))
    return res


def median_of(res, key, i):
    vals = res.get(key)
    return statistics.median(v[i] for v in vals.values()) if vals else None


SLOWDOWN_LIMIT = 3.0  # issue 11: busy at most 3x slower than idle


def paired_ratio(res, coll, n, size, mode, impl):
    """The median of the repetitions' ratios of `impl` to ours (> 1: we are
    better: less time, or more bandwidth), or None without pairs."""
    i = 0 if size < LATENCY_BYTES else 1
    ours, theirs = res[(coll, n, size, "ours", mode)], res.get((coll, n, size, impl, mode), {})
    pairs = [(ours[r][i], theirs[r][i]) for r in ours if r in theirs]
    rs = [(t / o if i == 0 else o / t) for o, t in pairs if o and t]
    return statistics.median(rs) if rs else None


def recheck(d, rounds, fresh):
    """Every cell where Open MPI is ahead, run again in `rounds` pairs (ci/ab.py's
    runs, side by side): whether it is behind in paired runs too, or the
    sweep's minute was (run while the sweep's conditions hold, e.g. its busy
    loop)."""
    res = load(d)
    keys = sorted({(c, n, s, m) for (c, n, s, impl, m) in res if impl == "ours"})
    below = [k for k in keys if (paired_ratio(res, *k, "mpi") or 1.0) < 1.0]
    # The sweep's buffers got huge pages if its largest size reached 2 MiB.
    huge = max(s for _, _, s, _ in keys) >= 2 << 20
    print(f"\nrecheck: the {len(below)} cells below 1.0, {rounds} paired runs each"
          f" (ci/ab.py; Open MPI's time over ours, > 1: we are ahead)")
    behind = 0
    for coll, n, size, mode in below:
        ip = mode == "in_place"
        bins = ["target/release/collbench", "mpi"]
        times = paired_runs(bins, rounds, coll, str(n), str(size), None, fresh, False, ip, huge)
        ours, mpi = (times[b] for b in bins)
        paired = statistics.median(m / o for o, m in zip(ours, mpi))
        behind += paired < 1.0
        sweep = paired_ratio(res, coll, n, size, mode, "mpi")
        us = lambda ts: f"{statistics.median(ts):.{3 if max(ts) < 1 else 1}f} us"
        print(f"{coll:<13} {n:>2} {human(size):>8} {'ip' if ip else 'oop':<4} sweep {sweep:.2f}"
              f"  paired {paired:.2f}  (ours {us(ours)}, Open MPI {us(mpi)})", flush=True)
    print(f"{behind} of {len(below)} behind in paired runs too")
    return 0


def main(d, idle_dir=None):
    res = load(d)
    idle = load(idle_dir) if idle_dir else None

    def med(key, i):
        return median_of(res, key, i)

    def slowdown(key, i):
        # busy over idle time: for bandwidth, idle over busy.
        busy, calm = med(key, i), median_of(idle, key, i)
        if not busy or not calm:
            return None
        return busy / calm if i == 0 else calm / busy

    keys = sorted({(c, n, s) for (c, n, s, _, _) in res})
    have_gloo = any(k[3] == "gloo" for k in res)
    head = f"{'collective':<13} {'n':>2} {'size':>8} {'mode':<6} {'metric':<9} {'ours':>9} {'Open MPI':>9} {'ratio':>6}"
    if have_gloo:
        head += f" {'Gloo':>9} {'ratio':>6}"
    if idle:
        head += f" {'x idle':>7} {'MPI x':>6}"
    print(head)
    print("-" * len(head))
    wrong = 0
    for coll, n, size in keys:
        for mode, short in [("out_of_place", "oop"), ("in_place", "ip")]:
            ours_key = (coll, n, size, "ours", mode)
            if ours_key not in res:
                continue
            wrong += sum(v[2] for impl in ["ours", "mpi", "gloo"] for v in res.get((coll, n, size, impl, mode), {}).values())
            latency = size < LATENCY_BYTES
            i = 0 if latency else 1
            metric = "time us" if latency else "busbw GB/s"

            def ratio(impl):
                r = paired_ratio(res, coll, n, size, mode, impl)
                return f"{r:.2f}" if r is not None else "-"

            mpi = med((coll, n, size, "mpi", mode), i)
            row = f"{coll:<13} {n:>2} {human(size):>8} {short:<6} {metric:<9} {med(ours_key, i):>9.2f} "
            row += f"{mpi:>9.2f} {ratio('mpi'):>6}" if mpi is not None else f"{'-':>9} {'-':>6}"
            if have_gloo:
                g = med((coll, n, size, "gloo", mode), i)
                row += f" {g:>9.2f} {ratio('gloo'):>6}" if g is not None else f" {'-':>9} {'-':>6}"
            if idle:
                ours_x, mpi_x = slowdown(ours_key, i), slowdown((coll, n, size, "mpi", mode), i)
                mark = "!" if ours_x and ours_x > SLOWDOWN_LIMIT else " "
                row += f" {ours_x:>6.2f}{mark}" if ours_x else f" {'-':>6} "
                row += f" {mpi_x:>6.2f}" if mpi_x else f" {'-':>6}"
            print(row)
    print(f"\nratio > 1: we are ahead (more bandwidth, or less time below {LATENCY_BYTES} B): the median of the"
          f" repetitions' ratios; values: medians of the repetitions; wrong values in all runs: {wrong}")
    if idle:
        print(f"x idle / MPI x: times slower than the idle run in {idle_dir} (ours / Open MPI; '!' over {SLOWDOWN_LIMIT:g}x)")
    print(line_round_trips(d))
    write_series(res, keys, d)
    return 1 if wrong else 0


def round_trips(d):
    """The cache-line round trips (ns) measured as each repetition began."""
    path = os.path.join(d, "linepingpong.txt")
    return [float(l.split()[-2]) for l in open(path)] if os.path.exists(path) else []


def reps(d, coll, n, size):
    """One cell, repetition by repetition (see --reps above)."""
    res = load(d)
    size = int(in_bytes(size))
    trips = round_trips(d)
    modes = ["out_of_place", "in_place"]
    cell = {(impl, m): res.get((coll, int(n), size, impl, m), {}) for impl in ["ours", "mpi"] for m in modes}
    if not cell[("ours", modes[0])]:
        print(f"no {coll} of {n} ranks at {human(size)} in {d}")
        return 1
    print(f"{coll}, {n} ranks, {human(size)}: time per call (us), out of place / in place")
    print(f"{'rep':>3} {'round trip':>10} {'ours':>17} {'Open MPI':>17} {'ratio':>11}")
    for rep in sorted(cell[("ours", modes[0])], key=int):
        trip = f"{trips[int(rep) - 1]:.0f} ns" if int(rep) <= len(trips) else "-"
        ours, mpi = ([cell[(impl, m)].get(rep, (None,))[0] for m in modes] for impl in ["ours", "mpi"])
        ratios = [f"{t / o:.2f}" if o and t else "-" for o, t in zip(ours, mpi)]
        shown = lambda ts: "/".join(f"{t:.1f}" if t else "-" for t in ts)
        print(f"{rep:>3} {trip:>10} {shown(ours):>17} {shown(mpi):>17} {'/'.join(ratios):>11}")
    print("ratio: Open MPI's time over ours (> 1: we are ahead)")
    return 0


def line_round_trips(d):
    """The machine's mode: the cache-line round trips between cores 0 and 1
    measured as each repetition began (ci/linepingpong.c)."""
    ns = round_trips(d)
    if not ns:
        return "cache-line round trip between the cores: not measured"
    return "cache-line round trip between the cores as each repetition began: " + ", ".join(f"{x:.0f}" for x in ns) + " ns"


NAMES = {"ours": "collectives", "mpi": "Open MPI", "gloo": "Gloo"}


def write_series(res, keys, d):
    """One collbench-shaped JSON per collective, rank count and library
    (medians, out of place; Gloo's only mode for allreduce is in place),
    for `collbench plot`: series-<coll>-<n>-<impl>.json in `d`."""
    for coll, n in sorted({(c, n) for c, n, _ in keys}):
        for impl, name in NAMES.items():
            if impl == "ours" and os.environ.get("COLL_SHARED_BUFFERS") == "1":
                name += " (shared buffers)"
            rows = []
            for c, k, size in keys:
                mode = "in_place" if (impl == "gloo" and coll == "allreduce") else "out_of_place"
                key = (c, k, size, impl, mode)
                if (c, k) == (coll, n) and key in res:
                    vals = res[key].values()
                    t, bw = statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals)
                    rows.append({"bytes": size, "out_of_place": {"time_us": t, "busbw_gbs": bw}})
            if rows:
                doc = {"collective": coll, "nranks": n, "label": f"{name}, {n} ranks", "rows": rows}
                with open(os.path.join(d, f"series-{coll}-{n}-{impl}.json"), "w") as f:
                    json.dump(doc, f)


if __name__ == "__main__":
    if "--reps" in sys.argv:
        at = sys.argv.index("--reps")
        sys.exit(reps(sys.argv[1], *sys.argv[at + 1:at + 4]))
    if "--recheck" in sys.argv:
        at = sys.argv.index("--recheck")
        sys.exit(recheck(sys.argv[1], int(sys.argv[at + 1]), "--fresh" in sys.argv))
    sys.exit(main(*sys.argv[1:3]))
