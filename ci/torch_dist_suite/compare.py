"""python ci/torch_dist_suite/compare.py gloo collectives [OUT]: the cases
that pass on the first run and not on the second, with the reason (run.py's
lists in OUT, target/dist-suite by default)."""
import sys
from pathlib import Path

a, b = sys.argv[1], sys.argv[2]
d = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(__file__).resolve().parents[2] / "target" / "dist-suite"
pa = set((d / f"{a}_pass.txt").read_text().split())
pb = set((d / f"{b}_pass.txt").read_text().split())
why = {}
for name in ("fail", "skip"):
    for line in (d / f"{b}_{name}.txt").read_text().splitlines():
        t, _, r = line.partition("\t")
        why[t] = f"{name.upper()}: {r}"
for t in sorted(pa - pb):
    print(f"{t}\t{why.get(t, 'not run')}")
print(f"# {len(pa - pb)} pass on {a} but not on {b}; {len(pb - pa)} pass on {b} but not on {a}", file=sys.stderr)
