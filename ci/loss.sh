#!/usr/bin/env bash
# ci/loss.sh BENCH: loss resiliency, inside the soft-RoCE VM (this machine's
# kernel has no sch_netem; the VM's has). ci/verbs.sh runs it there; alone:
#   ci/rxe.sh -- ci/loss.sh target/verbs/release/collbench
#
# Two routed "hosts" with a soft-RoCE device each, netem dropping packets in
# the router between them (ci/routed.sh).
#
# 1. AllReduce and AllToAll at 2 ranks, one per host, over verbs and over
#    TCP, with 0%, 0.1%, 1% and 5% loss: every result checked, every run
#    bounded; a table of the time per call and the slowdown against no loss.
# 2. The RC retry limit: every packet dropped in the middle of a verbs run.
#    A rank with a send in flight fails within a second, saying its retries
#    are exhausted (COLL_IB_TIMEOUT/COLL_IB_RETRY_CNT) and naming its peer;
#    one that only waits to receive has nothing to retry and no way to hear
#    of it (the side channel is cut too): it fails at its timeout, naming
#    the peer as unreachable (or, when the peer's exit reaches it after
#    all, as gone). At least one rank must be of the first kind.
set -euo pipefail
bench=$(realpath "${1:?usage: ci/loss.sh COLLBENCH}")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

. "$(dirname "$0")/routed.sh"

setup
for rate in 0 0.1 1 5; do
  loss "$rate"
  for t in verbs tcp; do
    for c in allreduce alltoall; do
      printf 'loss %s%%: %s over %s\n' "$rate" "$c" "$t"
      # Checked (-c 1); a hang fails the run at the timeout.
      pair "$out/$rate-$t-$c.json" "$c" --size 8,64K,1M --iters 10 -w 1 -c 1 \
        --transport "$t" --timeout 60
    done
  done
done
loss 0

python3 - "$out" <<'PY'
import json, sys, pathlib
d = pathlib.Path(sys.argv[1])
print("\n# time per call in us (2 ranks on two routed hosts, out of place, checked), and against no loss")
print(f"{'loss':>5}  {'transport':<9} {'collective':<10} {'8 B':>18} {'64 KiB':>18} {'1 MiB':>18}")
for t in ["verbs", "tcp"]:
    for c in ["allreduce", "alltoall"]:
        base = json.loads((d / f"0-{t}-{c}.json").read_text())["rows"]
        for rate in ["0", "0.1", "1", "5"]:
            rows = json.loads((d / f"{rate}-{t}-{c}.json").read_text())["rows"]
            cells = []
            for b, r in zip(base, rows):
                assert r["out_of_place"]["wrong"] == 0 and r["in_place"]["wrong"] == 0
                us, us0 = r["out_of_place"]["time_us"], b["out_of_place"]["time_us"]
                cells.append(f"{us:9.0f} ({us / us0:5.1f}x)")
            print(f"{rate + '%':>5}  {t:<9} {c:<10} " + " ".join(f"{x:>18}" for x in cells))
PY

echo
echo "every packet dropped during a verbs AllReduce: the retry limit"
export COLL_DEBUG=INFO COLL_IB_TIMEOUT=12 COLL_IB_RETRY_CNT=3
pair "$out/retry.json" allreduce --size 64K --iters 100000000 -w 0 -c 0 --transport verbs \
  --timeout 5 2>/dev/null &
job=$!
# Both ranks connected (a deadline, not a fixed sleep), then a few calls.
ready() { cat "$out"/rank*.log 2>/dev/null | grep -c 'communicator ready' || true; }
for _ in $(seq 600); do
  [ "$(ready)" -ge 2 ] && break
  sleep 0.1
done
[ "$(ready)" -ge 2 ] || { cat "$out"/rank*.log; echo "loss.sh: the ranks never connected" >&2; exit 1; }
sleep 1
loss 100
start=$(date +%s.%N)
if wait $job; then
  echo "loss.sh: the run went on with every packet dropped" >&2
  exit 1
fi
took=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { print e - s }')
loss 0
grep -h -E '^collbench: rank [0-9]+:' "$out"/rank*.log | cut -c1-420
exhausted=0
for r in 0 1; do
  p=$((1 - r))
  if grep -E "^collbench: rank $r: .*retries exhausted: no acknowledgement from peer rank $p" "$out/rank$r.log" >/dev/null; then
    exhausted=$((exhausted + 1))
  elif ! grep -E "^collbench: rank $r: .*(Timed out waiting .* peer rank $p .*root cause: rank $p did not answer|Connection closed by peer rank $p)" "$out/rank$r.log" >/dev/null; then
    tail -n 5 "$out/rank$r.log"
    echo "loss.sh: rank $r failed without naming rank $p as unreachable" >&2
    exit 1
  fi
done
[ $exhausted -ge 1 ] || { echo "loss.sh: no rank reported exhausted retries" >&2; exit 1; }
printf 'both ranks failed naming each other (%d of them: retries exhausted), %.1f s after the loss began\n' "$exhausted" "$took"
