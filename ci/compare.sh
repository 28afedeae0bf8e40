#!/usr/bin/env bash
# Side by side on this machine: collbench against Open MPI (Debian's
# openmpi-bin, its default shared-memory path, driven by ci/mpibench.c with
# collbench's own sizes, iteration rules, busbw definitions and checks: every
# collective against its MPI_* counterpart) and, when torch is importable,
# torch.distributed's Gloo backend (ci/gloo_bench.py; allreduce, alltoall).
# Runs are interleaved (ours, MPI, Gloo, repeat; ours and MPI swap places
# every other repetition) so machine noise hits all alike; the table shows
# medians and the median of each repetition's ratio (runs seconds apart:
# the machine's speed drifts between repetitions), and
# target/compare/<collective>.svg charts them (collbench plot).
#
#   ci/compare.sh [--reps N] [--ranks "2 4 8"] [--sizes "8 1M 16M 256M"]
#                 [--collectives "allreduce alltoall reducescatter allgather broadcast reduce"]
#                 [--busy [--idle DIR]] [--fresh] [--recheck N] [--shared-buffers]
#
# --busy: a busy loop pinned to the last core runs throughout (a data
# loader, a noisy neighbour: a training host is never idle), for every
# library alike. --idle DIR (the raw results of an idle run with the same
# --sizes, as its last line prints them: the largest size decides whether
# buffers get huge pages) adds how many times slower than idle each
# library is.
#
# --fresh: every library rewrites each call's input before the call
# (collbench --fresh), as a training step leaves fresh gradients. Without
# it, buffers are reused unchanged (as in nccl-tests), and a library that
# reads its peers' buffers in place (Open MPI's CMA single copy) finds them
# in its own cache: on this VM, in the minutes when a cache line takes
# ~500 ns between the cores instead of ~100, that makes Open MPI's 16-64
# KiB calls 2-3x faster than with fresh data. Each repetition prints that
# round trip (ci/linepingpong.c) and the table lists them (under --busy the
# busy loop shares a core with it: about twice as long).
#
# --recheck N: then runs every cell where Open MPI is ahead again, in N
# pairs of runs side by side (ci/compare_table.py --recheck), under the
# same conditions (the busy loop still runs): a cell behind in paired runs
# too is a gap to work on, one ahead there was the sweep's minute.
#
# --shared-buffers: our buffers are SharedBuffers (COLL_SHARED_BUFFERS=1,
# as collbench --shared-buffers): peers on the host map them and read
# large messages with memcpy, as NCCL's ncclMemAlloc memory. Open MPI's
# are its benchmark's own (huge pages, read with CMA). On a host whose
# /sys/kernel/mm/transparent_hugepage/shmem_enabled says "never", shared
# memory gets 4 KiB pages: set "advise" (as root) for huge ones.
#
# Needs Open MPI (installed with apt-get when run as root). Set
# PYTHON to a Python with torch for the Gloo column.
set -euo pipefail
cd "$(dirname "$0")/.."

reps=3 ranks="2 4 8" sizes="8 1M 16M 256M" busy=0 fresh= idle= recheck=0
collectives="allreduce alltoall reducescatter allgather broadcast reduce"
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) reps=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --collectives) collectives=$2; shift 2 ;;
    --busy) busy=1; shift ;;
    --fresh) fresh=--fresh; shift ;;
    --idle) idle=$2; shift 2 ;;
    --recheck) recheck=$2; shift 2 ;;
    --shared-buffers) export COLL_SHARED_BUFFERS=1; shift ;;
    -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "compare.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

# Open MPI's own compiler wrapper and launcher: with MPICH installed too,
# plain mpicc and mpirun may belong to different MPIs.
if ! command -v mpicc.openmpi >/dev/null || ! command -v mpirun.openmpi >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    echo "compare.sh: installing Open MPI (openmpi-bin libopenmpi-dev)..." >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q openmpi-bin libopenmpi-dev >/dev/null
  else
    echo "compare.sh: needs Open MPI: apt-get install openmpi-bin libopenmpi-dev" >&2
    exit 2
  fi
fi

out=target/compare
mkdir -p "$out"
cargo build --release -q -p collbench
mpicc.openmpi -O2 -o "$out/mpibench" ci/mpibench.c -lm
cc -O2 -pthread -o "$out/linepingpong" ci/linepingpong.c
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

python=${PYTHON:-python3}
gloo=0
if "$python" -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null; then
  gloo=1
else
  echo "compare.sh: no torch with Gloo in $python (set PYTHON); comparing with Open MPI only" >&2
fi

bytes() { "$python" - "$@" <<'PY'
import sys
m = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
print(" ".join(str(int(s[:-1]) * m[s[-1].upper()]) if s[-1].upper() in m else s for s in sys.argv[1:]))
PY
}
sizes_b=$(bytes $sizes)
list=$(echo $sizes | tr ' ' ',')
results=$(mktemp -d "$out/run.XXXXXX")
if [ $busy = 1 ]; then
  core=$(( $(nproc) - 1 ))
  taskset -c "$core" sh -c 'while :; do :; done' &
  hog=$!
  trap 'kill $hog 2>/dev/null' EXIT
  echo "compare.sh: a busy loop (pid $hog) holds core $core throughout" >&2
fi
run_mpi() {
  mpirun.openmpi -n "$2" "$out/mpibench" $fresh "$1" $sizes_b > "$results/mpi-$1-$2-$3.txt"
}
for rep in $(seq "$reps"); do
  # The machine's mode as this repetition starts (see --fresh above).
  "$out/linepingpong" 200000 | tee -a "$results/linepingpong.txt" >&2
  for coll in $collectives; do
    for n in $ranks; do
      echo "compare.sh: repetition $rep/$reps, $coll, $n ranks" >&2
      # Who goes first alternates: a run can leave the machine changed for
      # the next one (a rank the scheduler put beside the busy loop).
      if [ $((rep % 2)) = 0 ]; then run_mpi "$coll" "$n" "$rep"; fi
      target/release/collbench "$coll" -n "$n" --size "$list" -c 1 $fresh --json "$results/ours-$coll-$n-$rep.json" >/dev/null
      if [ $((rep % 2)) = 1 ]; then run_mpi "$coll" "$n" "$rep"; fi
      if [ $gloo = 1 ] && { [ "$coll" = allreduce ] || [ "$coll" = alltoall ]; }; then
        "$python" ci/gloo_bench.py $fresh "$coll" "$n" $sizes_b > "$results/gloo-$coll-$n-$rep.txt"
      fi
    done
  done
done
echo
status=0
"$python" ci/compare_table.py "$results" ${idle:+"$idle"} || status=$?
if [ "$recheck" -gt 0 ]; then
  "$python" ci/compare_table.py "$results" --recheck "$recheck" $fresh | tee "$results/recheck.txt"
fi
# One chart per collective: every library at every rank count.
for coll in $collectives; do
  target/release/collbench plot "$results"/series-"$coll"-*.json -o "$out/$coll.svg" >&2 ||
    echo "compare.sh: no chart for $coll" >&2
done
echo "compare.sh: charts in $out/*.svg; raw results in $results" >&2
exit $status
