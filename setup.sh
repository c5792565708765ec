#!/usr/bin/env bash
# Installs every Debian package kvcc needs (when missing) and builds it into ./build.
# CUDA kernels build too when nvcc is on the PATH (sm_90a); without it, the CPU reference alone.
#
# --with-python also makes (or reuses) the virtualenv ${KVCC_VENV:-~/.cache/kvcc/venv}, installs
# into it what the Python package and its tests need when an import fails (torch from the CPU
# wheel index KVCC_TORCH_INDEX, default https://download.pytorch.org/whl/cpu, else from PyPI;
# transformers, safetensors, h5py, numpy, pytest, scikit-build-core and hqq, the backend of
# transformers' quantized cache that kvcc.bench_generate compares with, from PyPI), runs
# `pip install ./python` into it and points ctest's Python tests at it (CMake's KVCC_PYTHON).
set -euo pipefail
cd "$(dirname "$0")"

with_python=0
for arg in "$@"; do
  case "$arg" in
    --with-python) with_python=1 ;;
    -h | --help)
      sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "setup: unknown argument $arg (usage: ./setup.sh [--with-python])" >&2
      exit 2
      ;;
  esac
done

packages=(
  build-essential cmake ninja-build pkg-config
  libeigen3-dev libopenblas-dev liblapacke-dev libhdf5-dev
  libcli11-dev libgtest-dev libgmock-dev nlohmann-json3-dev libpcre2-dev libicu-dev
  libopenmpi-dev openmpi-bin clang-format clang libclang-rt-dev
)
((with_python)) && packages+=(python3 python3-venv)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
cmake_args=()
if ((with_python)); then
  venv=${KVCC_VENV:-$HOME/.cache/kvcc/venv}
  [ -x "$venv/bin/python" ] || { echo "setup: creating the virtualenv $venv"; python3 -m venv "$venv"; }
  py="$venv/bin/python"
  # pip runs only for what is missing (a re-run with everything importable touches nothing).
  declare -A pip_name=([torch]=torch [transformers]=transformers [safetensors]=safetensors [h5py]=h5py
                       [numpy]=numpy [pytest]=pytest [scikit_build_core]=scikit-build-core [hqq]=hqq)
  missing_py=()
  for mod in torch transformers safetensors h5py numpy pytest scikit_build_core hqq; do
    "$py" -c "import $mod" >/dev/null 2>&1 || missing_py+=("$mod")
  done
  if [[ " ${missing_py[*]} " == *" torch "* ]]; then
    # The CPU wheel is a fraction of the default CUDA one; where its index cannot be reached,
    # the default index serves.
    echo "setup: installing torch into $venv"
    "$py" -m pip install -q --retries 1 --timeout 20 \
      --index-url "${KVCC_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" torch 2>/dev/null ||
      "$py" -m pip install -q torch
  fi
  others=()
  for mod in "${missing_py[@]}"; do [ "$mod" = torch ] || others+=("${pip_name[$mod]}"); done
  if ((${#others[@]})); then
    echo "setup: installing ${others[*]} into $venv"
    "$py" -m pip install -q "${others[@]}"
  fi
  # The package itself: the C++ library built through CMake (incrementally, in python/build/);
  # the CUDA kernels only where a GPU can run them, unless CMAKE_ARGS says otherwise.
  if [ -z "${CMAKE_ARGS:-}" ] && ! nvidia-smi -L >/dev/null 2>&1; then export CMAKE_ARGS=-DKVCC_CUDA=OFF; fi
  echo "setup: pip install ./python into $venv"
  "$py" -m pip install -q --no-build-isolation --no-deps ./python
  cmake_args+=("-DKVCC_PYTHON=$py")
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${cmake_args[@]}" >/dev/null
cmake --build build -j "$(nproc)"
echo "setup: built build/cli/kvcc"
