#!/usr/bin/env bash
# The Python package and the torch backend: makes (once) a virtual
# environment under ~/.cache/collectives/venv with torch, numpy, ml_dtypes,
# maturin and pytest (torch is PyPI's CUDA build, about 5 GB; it runs on
# CPU), builds and installs the wheel from this checkout (maturin reuses the
# crates target/ already compiled), and runs python/tests with pytest.
# COLL_REQUIRE_TORCH=1 (CI) makes a missing torch a failure, not a skip.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${COLL_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/collectives/venv}
py=$venv/bin/python
export PATH="$venv/bin:$PATH"
if ! "$py" -c 'import torch, numpy, ml_dtypes, pytest, maturin' 2>/dev/null; then
  echo "making the virtual environment $venv (torch is a large download)"
  python3 -m venv "$venv"
  "$py" -m pip install -q --upgrade pip
  "$py" -m pip install -q torch numpy ml_dtypes pytest maturin
fi
"$py" -m pip install -q --no-build-isolation --force-reinstall --no-deps ./python
"$py" -c 'import collectives, collectives.torch; print("collectives", collectives.__file__)'
exec "$py" -m pytest -q -p no:cacheprovider "$@" python/tests
