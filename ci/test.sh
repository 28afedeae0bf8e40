#!/usr/bin/env bash
# The project's test command (the README's): formatting and lints, one
# release build, every test from that build (the C ABI's included), then the
# checked collbench runs that show the main job works, the runnable blocks
# of README.md and docs/ (ci/doc_blocks.py), the overlap example,
# the Python package and torch backend (ci/python.sh), a smoke run of the
# Open MPI comparison when mpicc is there, and (as root) the verbs tests on
# soft-RoCE in a VM. Needs the Rust toolchain and python3; .ci/run installs
# what the optional steps need (Open MPI, MPICH, libclang, cmake; ci/rxe.sh
# its own; ci/python.sh makes the torch environment).
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step says when it began (seconds into the run), so a slow CI run
# shows which step grew.
step() { printf '\n=== %s (at %d s)\n' "$*" "$SECONDS"; }

if cargo fmt --version >/dev/null 2>&1; then
  step "cargo fmt --check"
  cargo fmt --all -- --check
else
  echo "note: rustfmt is not installed; skipping the format check"
fi
if cargo clippy --version >/dev/null 2>&1; then
  step "cargo clippy"
  cargo clippy --workspace --all-targets --release -- -D warnings
else
  echo "note: clippy is not installed; skipping lints"
fi

step "folders without circles of imports (ci/module_graph.py)"
python3 ci/module_graph.py
if rustdoc --version >/dev/null 2>&1; then
  step "cargo doc without warnings"
  RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
fi

step "build (release, once)"
cargo build --release --workspace --all-targets

# collbench with the mpi feature, against each MPI, for tests/mpi.rs.
if command -v mpicc.openmpi >/dev/null && command -v mpicc.mpich >/dev/null; then
  step "build with --features mpi against Open MPI and MPICH"
  cargo build --release -p collbench --features mpi --target-dir target/mpi-openmpi
  MPICC=mpicc.mpich cargo build --release -p collbench --features mpi --target-dir target/mpi-mpich
  export COLL_MPI_COLLBENCH_OPENMPI=$PWD/target/mpi-openmpi/release/collbench
  export COLL_MPI_COLLBENCH_MPICH=$PWD/target/mpi-mpich/release/collbench
fi

step "tests"
cargo test --release --workspace

bench=target/release/collbench
step "checked sweeps, 4 ranks, over TCP and shared memory"
for t in tcp shm; do
  $bench allreduce -n 4 -b 8 -e 256M -f 4 -c 1 --transport $t
  $bench alltoall -n 4 -b 8 -e 256M -f 4 -c 1 --transport $t
  $bench alltoallv -n 4 -b 8 -e 256M -f 4 -c 1 --transport $t
  for c in reducescatter allgather broadcast reduce; do
    $bench $c -n 4 -b 8 -e 64M -f 8 -c 1 --transport $t
  done
done
step "checked sweeps of every collective and algorithm, 2, 3, 4 and 8 ranks, TCP and shared memory"
for n in 2 3 4 8; do
  for t in shm tcp; do
    for c in allreduce alltoall alltoallv reducescatter allgather broadcast reduce; do
      for a in $($bench algorithms | awk -v c=$c '$1 == c {print $2}'); do
        # (hierarchical needs several hosts: tests/hosts.rs runs it on two)
        [ "$a" = hierarchical ] && continue
        $bench $c -n $n -b 8 -e 4M -f 32 -c 1 --transport $t --algo $a --root $((n - 1)) >target/sweep.log ||
          { cat target/sweep.log; exit 1; }
        grep -q "Out of bounds values : 0 OK" target/sweep.log || { cat target/sweep.log; exit 1; }
        echo "ok: $c $a, $n ranks, $t"
      done
    done
  done
done

step "the main job: 8 ranks x 1 GiB"
$bench allreduce -n 8 --size 1G

# Blocks marked `sh runnable` in README.md and docs/*.md, with target/release
# on the PATH, and every link of those pages (COLL_DOC_NEEDS=mpi,torch,...
# adds the blocks that need more than the build: see the script).
step "the README's and docs' runnable blocks"
python3 ci/doc_blocks.py

step "collbench tune writes a profile; the selector then follows it"
$bench tune -n 4 --out target/tune-profile.tsv
COLL_PROFILE=target/tune-profile.tsv COLL_DEBUG=info $bench allreduce -n 4 -b 8 -e 16M -f 16 -c 1 2>&1 |
  tee target/tune-run.log | grep -v "INFO"
grep -q "measured profile" target/tune-run.log

step "non-blocking AllReduces overlapping a backward pass (examples/data_parallel.rs)"
target/release/examples/data_parallel --steps 5

step "128 ranks over TCP form, lose a rank, agree and shrink (examples/scale.rs)"
target/release/examples/scale --ranks 128

step "the Python package and the torch backend (ci/python.sh: venv, wheel, pytest)"
ci/python.sh

if command -v mpicc.openmpi >/dev/null && command -v mpirun.openmpi >/dev/null; then
  step "comparison with Open MPI (smoke run: one repetition, 2 ranks)"
  ci/compare.sh --reps 1 --ranks 2 --sizes "8 1M" --collectives "allreduce alltoall reducescatter allgather broadcast reduce"
  python3 ci/compare_table.py "$(ls -td target/compare/run.* | head -1)" --reps allreduce 2 1M
else
  echo "note: no Open MPI; skipping the comparison smoke run (.ci/run installs it)"
fi

if [ "$(id -u)" = 0 ]; then
  step "verbs tests on soft-RoCE, in a VM (ci/verbs.sh)"
  ci/verbs.sh
else
  echo "note: not root; skipping the verbs tests on soft-RoCE (ci/verbs.sh needs apt-get and QEMU)"
fi
step "all passed"
