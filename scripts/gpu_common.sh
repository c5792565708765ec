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
#   gpu_link EXE MAIN.o DECODE.o [ARGS...]
#                              link MAIN.o against a decode object and the CMake libraries
#   gpu_build_bench_decode DIR [DECODE_CU]
#                              DIR/bench_decode built against DECODE_CU (default runtime/decode.cu)
#
# How a decode variant is linked: the variant's object comes first on the link line, then the
# CMake build's static libraries GPU_BUILD/runtime/libkvcc_runtime.a and
# GPU_BUILD/formats/libkvcc_formats.a. The linker takes an archive member only for symbols still undefined, so the
# variant's definitions win and the library's own decode.cu.o is not pulled in; everything else
# (cache allocator, append kernels, split planning, CPU references) comes from the library as it
# is now, whatever files hold it. A variant must therefore define every symbol the current
# decode.cu defines (else the library's decode object is pulled too and the link fails with
# duplicate symbols) and nothing that another library member defines. The shared C++ standard
# library is named before the archives: members carry their own weak copies of standard-library
# templates, and a member taken for one of those (say the HDF5 reader of libkvcc_formats.a) would
# bring in dependencies the benchmark does not have.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
GPU_BUILD=${GPU_BUILD:-build-gpu}
JOBS=${JOBS:-$(nproc)}
GPU_ARCH=-gencode=arch=compute_90a,code=sm_90a  # as CMake builds (CMAKE_CUDA_ARCHITECTURES 90a)
GPU_NVCC_FLAGS=(-std=c++17 -O3 "$GPU_ARCH" --expt-relaxed-constexpr -lineinfo -DKVCC_HAVE_CUDA=1 -I.)
GPU_LIBSTDCXX=$("${CXX:-g++}" -print-file-name=libstdc++.so 2>/dev/null)
[ -e "$GPU_LIBSTDCXX" ] || GPU_LIBSTDCXX=-lstdc++

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
  local exe=$1 main=$2 decode=$3
  shift 3
  nvcc "$GPU_ARCH" "$main" "$decode" "$GPU_LIBSTDCXX" \
    "$GPU_BUILD/runtime/libkvcc_runtime.a" "$GPU_BUILD/formats/libkvcc_formats.a" "$@" -o "$exe"
}

gpu_build_bench_decode() {
  local dir=$1 src=${2:-runtime/decode.cu}
  mkdir -p "$dir"
  gpu_cmake_build kvcc_runtime kvcc_formats >"$dir/cmake_build.txt" 2>&1 &
  local cmake_pid=$!
  gpu_nvcc -c bench/bench_decode.cu -o "$dir/bench.o" &
  local bench_pid=$!
  local failed=0
  gpu_nvcc -c "$src" -o "$dir/decode.o" || failed=1
  wait "$bench_pid" || failed=1
  wait "$cmake_pid" || { tail -20 "$dir/cmake_build.txt"; failed=1; }
  [ "$failed" = 0 ] && gpu_link "$dir/bench_decode" "$dir/bench.o" "$dir/decode.o"
}
