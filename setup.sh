#!/usr/bin/env bash
# Installs every Debian package kvcc needs (when missing) and builds it into ./build.
# CUDA kernels build too when nvcc is on the PATH (sm_90); without it, the CPU reference alone.
set -euo pipefail
cd "$(dirname "$0")"

packages=(
  build-essential cmake ninja-build pkg-config
  libeigen3-dev libopenblas-dev liblapacke-dev libhdf5-dev
  libcli11-dev libgtest-dev libgmock-dev nlohmann-json3-dev libpcre2-dev libicu-dev
  libopenmpi-dev openmpi-bin clang-format
)
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
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)"
echo "setup: built build/cli/kvcc"
