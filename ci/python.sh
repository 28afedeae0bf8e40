#!/usr/bin/env bash
# The Python package and the torch backend: makes (once) two virtual
# environments under ~/.cache/collectives/ and runs python/tests with
# pytest in the first.
#
# - venv: torch 2.15 (PyPI's CUDA build, about 5 GB; it runs on CPU),
#   torchft and what torchft's own tests import, numpy, ml_dtypes, maturin,
#   ninja (torch builds the backend's C++ with it), pytest.
# - venv-torchrec: torch 2.14.1 with TorchRec 1.9.2 and fbgemm-gpu-cpu
#   1.9.0, whose CPU kernels load on torch 2.14.1 and not on 2.15
#   ("undefined symbol: _ZN3c1015report_overflowEPKc"). TorchRec pulls in
#   the CUDA fbgemm-gpu, which shares its package directory: the CPU one
#   replaces it. The DLRM tests run there (COLL_TORCHREC_PYTHON).
#
# One wheel (abi3) is built from this checkout (maturin reuses the crates in
# target/) and installed in both; the backend's C++ is compiled for each
# torch here, once, not by the first test that imports it.
# COLL_REQUIRE_TORCH=1 (CI) makes a missing torch a failure, not a skip.
set -euo pipefail
cd "$(dirname "$0")/.."

cache=${XDG_CACHE_HOME:-$HOME/.cache}/collectives
venv=${COLL_VENV:-$cache/venv}
torchrec_venv=${COLL_TORCHREC_VENV:-$cache/venv-torchrec}
py=$venv/bin/python
export PATH="$venv/bin:$PATH"

# Makes venv $1 unless `python -c $2` already works there; $3... are the
# packages.
ensure() {
  local dir=$1 check=$2
  shift 2
  if ! "$dir/bin/python" -c "$check" 2>/dev/null; then
    echo "making the virtual environment $dir (torch is a large download)"
    python3 -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
    "$dir/bin/python" -m pip install -q "$@"
  fi
}

ensure "$venv" 'import torch, numpy, ml_dtypes, pytest, maturin, ninja, torchft, parameterized, expecttest; assert torch.__version__.startswith("2.15.")' \
  torch==2.15.0 numpy ml_dtypes pytest maturin ninja torchft==0.2.0 parameterized expecttest pytest-timeout
ensure "$torchrec_venv" 'import torch, torchrec, fbgemm_gpu, ninja; assert torch.__version__.startswith("2.14.1")' \
  torch==2.14.1 torchrec==1.9.2 numpy ml_dtypes ninja
if ! "$torchrec_venv/bin/python" -c 'import torchrec.distributed, fbgemm_gpu' 2>/dev/null; then
  "$torchrec_venv/bin/python" -m pip uninstall -q -y fbgemm-gpu fbgemm-gpu-cpu
  "$torchrec_venv/bin/python" -m pip install -q --no-deps fbgemm-gpu-cpu==1.9.0
fi

rm -rf target/wheels
maturin build -q --release -m python/Cargo.toml -o target/wheels
for v in "$venv" "$torchrec_venv"; do
  "$v/bin/python" -m pip install -q --force-reinstall --no-deps target/wheels/collectives-*.whl
  PATH="$v/bin:$PATH" "$v/bin/python" -c 'import collectives.torch as t; print("collectives", t.__file__, "backend", t.extension().__file__)'
done

export COLL_TORCHREC_PYTHON=$torchrec_venv/bin/python
exec "$py" -m pytest -q -p no:cacheprovider "$@" python/tests
