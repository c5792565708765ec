# Shared by the GPU scripts (source it; it is not run on its own): the repository root as the
# working directory, the output directory, provenance, the CMake build and hand-built decode
# variants linked against the CMake build's libraries.
#
# Environment:
#   OUT        output directory (default gpu_out/ in the repository root); created here
#   GPU_BUILD  the CMake build directory (default build-gpu, the one scripts/gpu_run.sh uses)
#   JOBS       parallel build jobs (default: all cores)
#   KVCC_COMMIT  the commit to record where the copy has no git metadata
#
# Functions:
#   gpu_provenance             prints date (ISO 8601 UTC), commit, GPU name, driver, clocks, temperature
#   gpu_cmake_build TARGET...  configure GPU_BUILD (Ninja, Release) and build the targets
#   gpu_nvcc ARGS...           nvcc with the project's flags (as CMake compiles the .cu files)
#   gpu_link EXE TARGET OBJECT
#                              EXE: the CMake target TARGET (e.g. bench/bench_decode, already built in
#                              GPU_BUILD) linked with OBJECT (a variant of one runtime .cu file) first
#   gpu_build_bench_decode DIR [DECODE_CU]
#                              DIR/bench_decode built against DECODE_CU (default runtime/decode.cu)
#
# How a variant is linked: gpu_link takes the target's own link command from GPU_BUILD's Ninja
# files (so every library and system dependency is there, whatever they become) and puts the
# variant's object right after the target's objects, before the static libraries. The linker takes
# an archive member only for symbols still undefined, so the variant's definitions win and the
# library's own object of that file is not pulled in; everything else comes from the libraries as
# they are now. A variant must therefore define every symbol the current file defines (else the
# library's object is pulled too and the link fails with duplicate symbols) and nothing that
# another library member defines.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
GPU_BUILD=${GPU_BUILD:-build-gpu}
JOBS=${JOBS:-$(nproc)}
GPU_ARCH=-gencode=arch=compute_90a,code=sm_90a  # as CMake builds (CMAKE_CUDA_ARCHITECTURES 90a)
GPU_NVCC_FLAGS=(-std=c++17 -O3 "$GPU_ARCH" --expt-relaxed-constexpr -lineinfo -DKVCC_HAVE_CUDA=1 -I.)

gpu_provenance() {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  local commit=${KVCC_COMMIT:-}
  if [ -z "$commit" ]; then
    commit=$(git rev-parse --short HEAD 2>/dev/null) || commit="unknown (no git metadata; set KVCC_COMMIT)"
    if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then commit="$commit + local changes"; fi
  fi
  echo "commit: $commit"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
}

gpu_cmake_build() {
  cmake -S . -B "$GPU_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null &&
    cmake --build "$GPU_BUILD" --target "$@" -j"$JOBS"
}

gpu_nvcc() {
  nvcc "${GPU_NVCC_FLAGS[@]}" "$@"
}

gpu_link() {
  local exe=$1 target=$2 object=$3 cmd
  case $exe in /*) ;; *) exe=$PWD/$exe ;; esac
  case $object in /*) ;; *) object=$PWD/$object ;; esac
  cmd=$(cd "$GPU_BUILD" && ninja -t commands "$target" | tail -1) || return 1
  local from=" -o $target " to=" -o $exe $object "
  [ "${cmd/"$from"/"$to"}" != "$cmd" ] || { echo "gpu_link: no '-o $target' in the link command of $target"; return 1; }
  (cd "$GPU_BUILD" && eval "${cmd/"$from"/"$to"}")
}

gpu_build_bench_decode() {
  local dir=$1 src=${2:-runtime/decode.cu}
  mkdir -p "$dir"
  gpu_cmake_build bench_decode >"$dir/cmake_build.txt" 2>&1 &
  local cmake_pid=$!
  local failed=0
  gpu_nvcc -c "$src" -o "$dir/decode.o" || failed=1
  wait "$cmake_pid" || { tail -20 "$dir/cmake_build.txt"; failed=1; }
  [ "$failed" = 0 ] && gpu_link "$dir/bench_decode" bench/bench_decode "$dir/decode.o"
}
