#!/usr/bin/env bash
# Many ranks on one host, ours against Open MPI's: for each rank count, a
# checked sweep (AllReduce, then AllToAll, 8 B to 1 MiB) of collbench over
# shared memory, then the same collectives of Open MPI (ci/mpibench.c,
# vader), each run alone, while /proc/meminfo's Shmem is sampled every
# 20 ms. Prints, per rank count and library: wall seconds of the whole run,
# the peak of shared memory above the idle machine's, and (ours) the
# slowest rank's start-up and the connections it held, from collbench's
# footer.
#
#   ci/scale.sh [--ranks "16 32 64 128"]
#
# Needs target/release/collbench (cargo build --release) and, for Open
# MPI's side, mpicc and mpirun (Debian's openmpi-bin, libopenmpi-dev).
set -euo pipefail
cd "$(dirname "$0")/.."
ranks="16 32 64 128"
# One list for both libraries (a -b/-e/-f sweep stops below -e when the
# factor steps past it: ours had run up to 256 KiB, Open MPI's to 1 MiB).
sizes="8 256 8192 262144 1048576"
ours_sizes="--size ${sizes// /,}"
while [ $# -gt 0 ]; do
    case "$1" in
        --ranks) ranks="$2"; shift 2 ;;
        *) echo "unknown flag $1" >&2; exit 2 ;;
    esac
done
out=target/scale
mkdir -p "$out"
mpi=""
if command -v mpicc.openmpi >/dev/null && command -v mpirun.openmpi >/dev/null; then
    mpi="$out/mpibench"
    mpicc.openmpi -O2 -o "$mpi" ci/mpibench.c -lm
fi

# measure NAME CMD...: runs CMD, prints "NAME wall peak_MiB", keeps its output.
measure() {
    local name=$1; shift
    local base peak v start rc
    base=$(awk '/^Shmem:/{print $2}' /proc/meminfo)
    peak=$base
    start=$(date +%s.%N)
    "$@" >"$out/$name.txt" 2>&1 &
    local pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        v=$(awk '/^Shmem:/{print $2}' /proc/meminfo)
        [ "$v" -gt "$peak" ] && peak=$v
        sleep 0.02
    done
    rc=0; wait "$pid" || rc=$?
    printf '%-28s %8.2f s %8d MiB' "$name" "$(echo "$(date +%s.%N) - $start" | bc)" $(((peak - base) / 1024))
    [ "$rc" = 0 ] || printf '  FAILED (%s: %s)' "$rc" "$out/$name.txt"
    echo
}

for n in $ranks; do
    measure "ours-$n" bash -c "target/release/collbench allreduce -n $n $ours_sizes -c 1 --oversubscribe \
        && target/release/collbench alltoall -n $n $ours_sizes -c 1 --oversubscribe"
    grep -h "Start-up" "$out/ours-$n.txt" | sed "s/^# */    /" || true
    if [ -n "$mpi" ]; then
        measure "openmpi-$n" bash -c "mpirun.openmpi --oversubscribe --allow-run-as-root -n $n $mpi allreduce $sizes \
            && mpirun.openmpi --oversubscribe --allow-run-as-root -n $n $mpi alltoall $sizes"
    fi
done
