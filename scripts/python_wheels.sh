#!/usr/bin/env bash
# Downloads, as wheels into DIR, what `pip install ./python` needs on a machine without network
# access: the build requirements (scikit-build-core and its dependencies) and the runtime
# dependencies an image with torch may lack (numpy, h5py, safetensors). Then, on that machine:
#     pip install --no-index --find-links DIR ./python
# (CMake >= 3.25, a C++20 compiler and the HDF5, Eigen and nlohmann-json headers must be there;
# torch and transformers are not downloaded: the package never requires them at install.)
# usage: scripts/python_wheels.sh DIR
# Target: CPython ${KVCC_WHEELS_PYTHON:-3.12} on x86-64 Linux (manylinux), the GPU image's.
set -euo pipefail
if [ $# -ne 1 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
dir=$1
mkdir -p "$dir"
pyver=${KVCC_WHEELS_PYTHON:-3.12}
py=${PYTHON:-python3}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$py" -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp "${platforms[@]}" \
  -d "$dir" "scikit-build-core>=0.10" pathspec packaging numpy h5py safetensors pytest
echo "python_wheels: $(ls "$dir" | wc -l) wheels in $dir ($(du -sh "$dir" | cut -f1)):"
ls "$dir"
