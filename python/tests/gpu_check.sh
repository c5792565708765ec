#!/usr/bin/env bash
# The Python package on a GPU machine without network access: installs it from the repository
# with the wheels of scripts/python_wheels.sh (DIR, default .device/py/wheels), then runs the
# CPU and CUDA tests against the installed package (the CUDA ones need a Hopper GPU). Logs go
# to $OUT (default ./gpu_py_out): install.txt (the whole pip output) and pytest.txt.
# usage: python/tests/gpu_check.sh [WHEELS_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
wheels=${1:-.device/py/wheels}
OUT=${OUT:-$PWD/gpu_py_out}
mkdir -p "$OUT"
# pip installs into the Python that has torch when it is a virtual environment (as on a GPU image
# that ships torch in a venv); a system Python is externally managed (PEP 668), so then into a venv
# that sees its packages.
py=${PYTHON:-python3}
if ! "$py" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  "$py" -m venv --system-site-packages /tmp/kvcc-venv
  py=/tmp/kvcc-venv/bin/python
fi
t0=$(date +%s)
# The build requirements go into the environment itself and the build runs there (no build
# isolation): an isolated build would find the image venv's `cmake` shim without its module.
PIP_NO_CACHE_DIR=1 "$py" -m pip install --no-index --find-links "$wheels" "scikit-build-core>=0.10" pytest \
  >"$OUT/install.txt" 2>&1 &&
  PIP_NO_CACHE_DIR=1 "$py" -m pip install -v --no-build-isolation --no-index --find-links "$wheels" ./python \
    >>"$OUT/install.txt" 2>&1
rc=$?
echo "pip install exit $rc in $(($(date +%s) - t0)) s (log: $OUT/install.txt)"
if [ $rc -ne 0 ]; then
  grep -n -i -E "error|not found|could not|failed" "$OUT/install.txt" | head -40
  exit $rc
fi
# From /tmp, so that `import kvcc` is the installed package, not the checkout's python/.
repo=$PWD
(cd /tmp && "$py" -c "import kvcc; print('kvcc', kvcc.__version__, kvcc._lib.library_path())" &&
  PYTHONUNBUFFERED=1 timeout "${PYTEST_TIMEOUT:-300}" "$py" -m pytest -q -p no:cacheprovider -p no:logging -rs -s \
    --rootdir "$repo/python" "$repo/python/tests/test_cuda.py" "$repo/python/tests/test_runtime.py" \
    "$repo/python/tests/test_api.py") 2>&1 | grep -v '^DEBUG' | tee "$OUT/pytest.txt"
