#!/usr/bin/env bash
# ci/rankcpu.sh: how much CPU the rank beside a busy loop spends, rather
# than how long the run took. Beside a busy loop, a run's wall clock swings
# 1.5-3x from minute to minute with the VM and the scheduler; the work the
# rank on the shared core does per call moves less (2-rank 8 B Broadcast:
# 906-1176 ms of CPU for 8 million calls where the time per call read
# 0.17-0.28 us), so two builds (or settings) compare by it more surely.
#
#   ci/rankcpu.sh COLLECTIVE SIZE ITERS BIN [KEY=VALUE ...]
#
# Runs `BIN COLLECTIVE -n 2 --size SIZE --iters ITERS` (out of place and in
# place) under `perf record -C 1` with a busy loop pinned to core 1 (where
# collbench binds rank 1), and prints the times per call and the CPU
# milliseconds the ranks used on core 1. KEY=VALUE: environment for BIN
# (COLL_CHUNK=256K, say). The fixed cost of starting and settling (~0.2-0.4 s)
# is in the figure too: compare runs with the same ITERS, or take the
# difference of two ITERS. Needs perf (linux-perf) and 2 cores.
set -euo pipefail
[ $# -ge 4 ] || { sed -n '2,/^set/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; }
coll=$1 size=$2 iters=$3 bin=$4
shift 4
data=$(mktemp /tmp/rankcpu.XXXXXX)
taskset -c 1 sh -c 'while :; do :; done' &
hog=$!
trap 'kill $hog 2>/dev/null; rm -f "$data"' EXIT
env "$@" perf record -q -e cpu-clock -C 1 -o "$data" -- \
  "$bin" "$coll" -n 2 --size "$size" --iters "$iters" 2>&1 |
  awk '$1 ~ /^[0-9]+$/ && NF >= 12 { printf "time per call: out of place %s us, in place %s us; ", $5, $9 }'
kill $hog
perf report -i "$data" --sort comm --stdio 2>/dev/null |
  awk -v comm="$(basename "$bin")" '
    /Event count/ { ns = $NF }
    $2 == comm { share = $1 + 0 }
    END { printf "ranks on core 1: %.0f ms of CPU\n", ns * share / 100 / 1e6 }'
