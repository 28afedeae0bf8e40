#!/usr/bin/env bash
# ci/loss.sh BENCH: loss resiliency, inside the soft-RoCE VM (this machine's
# kernel has no sch_netem; the VM's has). ci/verbs.sh runs it there; alone:
#   ci/rxe.sh -- ci/loss.sh target/verbs/release/collbench
#
# Two "hosts", A (10.0.1.1 on vethA, soft-RoCE device rxeA) and B (10.0.2.1
# on vethB, rxeB), whose traffic crosses a router namespace where netem drops
# packets both ways. (rxe on one interface delivers to itself without
# touching the network, and a kernel delivers traffic between its own
# addresses locally: policy routing sends A<->B out through the router.)
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

setup() {
  ip netns add router
  ip -n router link set lo up
  ip netns exec router sysctl -qw net.ipv4.ip_forward=1
  local h n
  for h in A:1 B:2; do
    n=${h#*:} h=${h%:*}
    ip link add "veth$h" type veth peer name "r$h"
    ip link set "r$h" netns router
    ip addr add "10.0.$n.1/24" dev "veth$h"
    ip link set "veth$h" up
    ip -n router addr add "10.0.$n.254/24" dev "r$h"
    ip -n router link set "r$h" up
    # What this host sends to the other leaves through the router.
    ip route add "10.0.$((3 - n)).1" via "10.0.$n.254" dev "veth$h" table 100
    ip rule add pref "$((9 + n))" iif lo to "10.0.$((3 - n)).1" lookup 100
  done
  # Those rules before local delivery; packets from "the other host" with
  # a local source address accepted.
  ip rule add pref 100 lookup local
  ip rule del pref 0
  for k in all default vethA vethB; do
    sysctl -qw "net.ipv4.conf.$k.accept_local=1" "net.ipv4.conf.$k.rp_filter=0"
  done
  rdma link add rxeA type rxe netdev vethA
  rdma link add rxeB type rxe netdev vethB
}

loss() {
  local d
  for d in rA rB; do
    ip netns exec router tc qdisc del dev $d root 2>/dev/null || true
    [ "$1" = 0 ] || ip netns exec router tc qdisc add dev $d root netem loss "$1%"
  done
}

# pair JSON ARGS...: rank 0 on host A (writing JSON), rank 1 on host B.
port=29600
pair() {
  local json=$1
  shift
  port=$((port + 1))
  local env=(MASTER_ADDR=10.0.1.1 MASTER_PORT=$port WORLD_SIZE=2)
  env "${env[@]}" RANK=1 COLL_SOCKET_IFNAME=vethB "$bench" "$@" >/dev/null 2>"$out/rank1.log" &
  local one=$! status=0
  env "${env[@]}" RANK=0 COLL_SOCKET_IFNAME=vethA "$bench" "$@" --json "$json" >/dev/null 2>"$out/rank0.log" || status=$?
  wait $one || status=$?
  [ $status = 0 ] || { tail -n 5 "$out"/rank*.log; echo "loss.sh: failed: $*" >&2; return 1; }
}

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
