#!/usr/bin/env python3
"""How good the selector's default is: runs one collective at each size with
every algorithm forced and with the default choice, interleaved, several
repetitions, and prints per size the median time of each, the best forced
algorithm, and default / best (the issue's bar: at most 1.10).

    ci/selector.py allreduce -n 8 [--sizes 8,1K,32K,256K,1M,4M,16M,64M] [--reps 3]
    ci/selector.py allreduce --ranks-per-host 4 --prefix '...'   (see --help)

Extra arguments after `--` go to every collbench run (e.g. `-- --transport tcp`).
The environment is passed on: COLL_PROFILE selects a profile, as for any run.
"""
import argparse
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
COLLBENCH = os.path.join(HERE, "..", "target", "release", "collbench")


def algorithms(collective):
    out = subprocess.run([COLLBENCH, "algorithms"], capture_output=True, text=True, check=True).stdout
    # (hierarchical runs as the ring on one host: it would only measure noise)
    return [l.split()[1] for l in out.splitlines()
            if l.split() and l.split()[0] == collective and l.split()[1] != "hierarchical"]


def run(collective, n, sizes, algo, extra):
    cmd = [COLLBENCH, collective, "-n", str(n), "--size", sizes, "-c", "0"] + extra
    if algo != "default":
        cmd += ["--algo", algo]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    times = {}
    for line in out.stdout.splitlines():
        f = line.split()
        if f and f[0].isdigit():
            # out-of-place and in-place times: the same algorithm, both count
            times[int(f[0])] = [float(f[4]), float(f[8])]
    return times


def chosen(collective, n, sizes, extra):
    """The algorithm the default picks at each size, from the debug log."""
    cmd = [COLLBENCH, collective, "-n", str(n), "--size", sizes, "-c", "0", "--iters", "1", "-w", "0"] + extra
    env = dict(os.environ, COLL_DEBUG="debug")
    log = subprocess.run(cmd, capture_output=True, text=True, env=env).stderr
    picks = {}
    for line in log.splitlines():
        if "start rank=0" in line and f"op={collective} #" in line and "x f32" in line:
            count = int(line.split("(")[1].split(" x ")[0])
            picks.setdefault(count * 4, line.split('algo="')[1].split('"')[0])
    return picks


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("collective")
    p.add_argument("-n", type=int, default=8)
    p.add_argument("--sizes", default="8,1K,32K,256K,1M,4M,16M,64M")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("extra", nargs="*")
    a = p.parse_args()
    algos = algorithms(a.collective)
    samples = {}
    for _ in range(a.reps):
        for algo in algos + ["default"]:
            for size, ts in run(a.collective, a.n, a.sizes, algo, a.extra).items():
                samples.setdefault((size, algo), []).extend(ts)
    med = {k: statistics.median(v) for k, v in samples.items()}
    picks = chosen(a.collective, a.n, a.sizes, a.extra)
    sizes = sorted({s for s, _ in med})
    print(f"# {a.collective}, {a.n} ranks, median time (us) of {a.reps} interleaved runs x out/in-place")
    print("# default: its own runs; choice: what it picks (debug log); choice/best: that")
    print("# algorithm's forced time over the best forced time (noise between runs of one")
    print("# algorithm is in default vs its forced column)")
    print(f"{'size':>10} " + " ".join(f"{x:>12}" for x in algos)
          + f" {'default':>10} {'choice':>12} {'best':>12} {'choice/best':>11} {'default/best':>12}")
    worst = 0.0
    for s in sizes:
        forced = {x: med[(s, x)] for x in algos if (s, x) in med}
        best = min(forced, key=forced.get)
        pick = picks.get(s, "?")
        ratio = forced.get(pick, float("nan")) / forced[best]
        worst = max(worst, ratio)
        print(f"{s:>10} " + " ".join(f"{forced.get(x, float('nan')):12.1f}" for x in algos)
              + f" {med[(s, 'default')]:10.1f} {pick:>12} {best:>12} {ratio:11.2f}"
              + f" {med[(s, 'default')] / forced[best]:12.2f}")
    print(f"# worst choice/best: {worst:.2f}")


if __name__ == "__main__":
    main()
