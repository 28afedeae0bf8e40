#!/usr/bin/env bash
# The project's test command (the README's): formatting and lints, one
# release build, every test from that build, then the checked collbench runs
# that show the main job works. Needs only the Rust toolchain.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n=== %s\n' "$*"; }

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

step "build (release, once)"
cargo build --release --workspace --all-targets

step "tests"
cargo test --release --workspace

bench=target/release/collbench
step "checked sweeps over TCP, 4 ranks"
$bench allreduce -n 4 -b 8 -e 256M -f 4 -c 1 --transport tcp
$bench alltoall -n 4 -b 8 -e 256M -f 4 -c 1 --transport tcp

step "the main job: 8 ranks x 1 GiB"
$bench allreduce -n 8 --size 1G
