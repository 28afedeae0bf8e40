#!/usr/bin/env bash
# ci/windows.sh BENCH [ROUNDS] [ITERS]: what verbs memory windows cost and
# whether they hold under packet loss, inside the soft-RoCE VM (by hand; not
# part of CI, about 20 minutes):
#   ci/rxe.sh -t 2400 -- ci/windows.sh target/verbs/release/collbench 5 500
#
# 1. AllReduce and AllToAll of 8 B to 1 MiB at 2 ranks on two routed hosts
#    (ci/routed.sh), with windows off (COLL_IB_WINDOWS=0) and on, side by
#    side in ROUNDS rounds (default 3): time per call, median, and the
#    median of each round's ratio. Emulated: a rough guide, not RDMA speeds.
# 2. ITERS (default 300) checked calls of each at 0.1% and 1% loss with
#    windows on: every result right, no hang (a 60 s timeout).
set -euo pipefail
bench=$(realpath "${1:?usage: ci/windows.sh COLLBENCH [ROUNDS] [ITERS]}")
rounds=${2:-3} iters=${3:-300}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

. "$(dirname "$0")/routed.sh"

setup
for r in $(seq "$rounds"); do
  for w in 0 1; do
    for c in allreduce alltoall; do
      COLL_IB_WINDOWS=$w pair "$out/ab-$r-$w-$c.json" "$c" --size 8,4K,64K,1M \
        --iters 200 -w 10 -c 0 --transport verbs --timeout 60
    done
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, pathlib, statistics, sys
d, rounds = pathlib.Path(sys.argv[1]), int(sys.argv[2])
for c in ["allreduce", "alltoall"]:
    print(f"\n# {c}: us per call with windows off and on (median of {rounds} rounds), median ratio on/off")
    runs = {w: [json.loads((d / f"ab-{r}-{w}-{c}.json").read_text())["rows"] for r in range(1, rounds + 1)] for w in (0, 1)}
    us = lambda w, r, i: runs[w][r][i]["out_of_place"]["time_us"]
    for i, row in enumerate(runs[0][0]):
        off = statistics.median(us(0, r, i) for r in range(rounds))
        on = statistics.median(us(1, r, i) for r in range(rounds))
        ratio = statistics.median(us(1, r, i) / us(0, r, i) for r in range(rounds))
        print(f"{row['bytes']:>9} B  off {off:9.0f}  on {on:9.0f}  {ratio:5.2f}x")
PY
for rate in 0.1 1; do
  loss "$rate"
  for c in allreduce alltoall; do
    printf '\nloss %s%%: %d checked %s calls of each size, windows on\n' "$rate" "$iters" "$c"
    SECONDS=0
    pair "$out/loss-$rate-$c.json" "$c" --size 8,64K,1M --iters "$iters" -w 1 -c 1 \
      --transport verbs --timeout 60
    echo "  right, in $SECONDS s"
  done
done
loss 0
