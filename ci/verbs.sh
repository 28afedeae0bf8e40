#!/usr/bin/env bash
# ci/verbs.sh: the RDMA verbs tests on soft-RoCE. Builds with the verbs
# feature (needs cmake and libclang: rdma-core's headers are built by the
# rdma-mummy-sys crate), then boots one VM with ci/rxe.sh and runs inside it
# the transport contract tests, the verbs parts of the correctness matrix
# and of the fault tests, checked collbench sweeps, a run under mpirun, and
# the loss tests (ci/loss.sh: netem on a routed path, retries exhausted).
# COLL_REQUIRE_VERBS=1 inside: a missing device fails instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = --in-vm ]; then
  # Through a pipe: progress lines meant for terminals would flood the log.
  if [ -t 1 ]; then
    "$0" "$@" 2>&1 | cat
    exit "${PIPESTATUS[0]}"
  fi
  shift
  export COLL_REQUIRE_VERBS=1
  bench=target/verbs/release/collbench
  step() { printf '\n=== (soft-RoCE VM) %s (at %d s in the VM)\n' "$*" "$SECONDS"; }
  step "transport contract tests, and the verbs transport's own (memory windows, grants)"
  "$1" --test-threads 1
  "$4" verbs:: --test-threads 1
  step "correctness matrix over verbs"
  "$2" verbs --test-threads 1
  step "faults over verbs"
  "$3" verbs --test-threads 1
  step "checked sweeps over verbs, 3 ranks, every collective"
  # 20 timed calls a size: under software emulation a call of 8 B takes ~5 ms,
  # so the default (1000 or more up to 64 KiB) took 5 s a size and mode and
  # measured nothing; the run under mpirun below keeps the default counts.
  sweep="-c 1 --iters 20 -w 2 --transport verbs"
  $bench allreduce -n 3 -b 8 -e 64M -f 8 $sweep
  $bench alltoall -n 3 -b 8 -e 64M -f 8 $sweep
  $bench alltoallv -n 3 -b 8 -e 64M -f 8 $sweep
  for c in reducescatter allgather broadcast reduce; do
    $bench $c -n 3 -b 8 -e 1M -f 32 $sweep
  done
  if command -v mpirun.openmpi >/dev/null; then
    step "collbench under Open MPI's mpirun, over verbs"
    mpirun.openmpi --allow-run-as-root --oversubscribe -n 2 \
      $bench allreduce -b 8 -e 1M -f 32 -c 1 --transport verbs
  fi
  # Last: it reroutes the VM's traffic between two new "hosts".
  step "loss resiliency: verbs and tcp through a lossy router (ci/loss.sh)"
  ci/loss.sh $bench
  exit 0
fi

# The build needs cmake and libclang (.ci/run installs them; so does this, as root).
if ! command -v cmake >/dev/null || ! dpkg -s libclang-dev >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || { echo "verbs.sh: the verbs build needs cmake and libclang-dev" >&2; exit 1; }
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q cmake libclang-dev >/dev/null 2>&1 || {
    apt-get update -q >/dev/null
    apt-get install -y -q cmake libclang-dev >/dev/null
  }
fi

features=transport/verbs,collbench/verbs,integration-tests/verbs
build=(--release --features "$features" -p transport -p collbench -p integration-tests
  --target-dir target/verbs)
cargo build "${build[@]}" --bins
# The test executables, by name, from cargo's own listing.
tests=$(cargo test "${build[@]}" --no-run 2>&1 | sed -n 's/.*Executable .* (\(.*\))$/\1/p')
exe() { grep "/deps/$1-" <<<"$tests"; }
ci/rxe.sh -t 2400 -- ci/verbs.sh --in-vm "$(exe contract)" "$(exe matrix)" "$(exe faults)" "$(exe transport)"
