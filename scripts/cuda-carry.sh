#!/bin/bash
# Packs what a GPU machine that has the CUDA driver and toolkit but none of
# the project's Debian dependencies needs to run the CUDA backend's tests,
# the device generation tests and `pagekv bench attention --device cuda`:
# this machine's release binaries (built here with the toolkit: sm_80 / sm_90
# code and PTX), the shared libraries they load other than the C runtime's,
# the compiler's and CUDA's (the GPU machine has those), and the test data
# they read (stories260K and its golden). Output: build/device/carry.tar.xz
# (xz: the lend's carry is 64 MiB); name build/device in the run's carry and
# scripts/cuda-device-check.sh unpacks it and runs them from there.
#   scripts/cuda-carry.sh            (BUILD=build/release by default)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
build="${BUILD:-build/release}"
shared="${PAGEKV_SHARED:-$root/../shared}"
if [ ! -f "$build/CMakeCache.txt" ] || ! grep -q '^PAGEKV_CUDA:STRING=\(AUTO\|ON\)' "$build/CMakeCache.txt"; then
  echo "cuda-carry: $build is not a configured build with CUDA: run make build on a machine with the CUDA toolkit first" >&2
  exit 2
fi
if [ ! -f "$build/src/cuda/CTestTestfile.cmake" ]; then
  echo "cuda-carry: $build found no CUDA compiler when it was configured: install the CUDA toolkit and reconfigure" >&2
  exit 2
fi
cmake --build "$build" --target pagekv_cuda_backend_test pagekv_engine_test pagekv_cli > /dev/null
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib" "$stage/shared/models/stories260K" "$stage/shared/goldens" "$stage/repo"
cp "$build/src/cuda/pagekv_cuda_backend_test" "$build/src/engine/pagekv_engine_test" "$build/bin/pagekv" "$stage/bin/"
strip --strip-unneeded "$stage"/bin/*
for b in "$stage"/bin/*; do ldd "$b"; done | awk '$3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r name path; do
    case "$name" in
      libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|libresolv.so*|ld-linux*|libstdc++*|libgcc_s*|libcuda*|libcublas*|libcudart*) ;;
      *) cp -L "$path" "$stage/lib/$name" ;;
    esac
  done
cp "$shared"/models/stories260K/{stories260K.gguf,stories260K.bin,tok512.bin} "$stage/shared/models/stories260K/"
cp "$shared/goldens/stories260K.json" "$stage/shared/goldens/"
mkdir -p build/device
tar -C "$stage" -cJf build/device/carry.tar.xz .
ls -la build/device/carry.tar.xz | awk '{print "build/device/carry.tar.xz: " $5 " bytes"}'
