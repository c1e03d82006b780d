#!/bin/bash
# The GPU checks, for a machine with an NVIDIA GPU and the CUDA toolkit but
# none of the project's other dependencies: builds the CUDA kernels' test
# with nvcc alone, runs it (every case against the double reference), then
# the benchmark (the device's streaming read bandwidth and each decode
# shape's share of it) and the PyTorch peer on the same shapes. Output under
# $OUT (default build/cuda-check): build.log, test.log, bench.log, peer.log.
set -u
OUT=${OUT:-build/cuda-check}
mkdir -p "$OUT"
BIN=$(mktemp -d)/paged_attention_test
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$OUT/device.txt" 2>&1
nvcc --version >> "$OUT/device.txt" 2>&1
if ! nvcc -O3 -std=c++17 -lineinfo -gencode arch=compute_90,code=sm_90 -Xptxas -v -Isrc \
    src/cuda/paged_attention.cu src/cuda/paged_attention_test.cu -o "$BIN" > "$OUT/build.log" 2>&1; then
  echo "build failed"; tail -30 "$OUT/build.log"; exit 1
fi
"$BIN" > "$OUT/test.log" 2>&1; test_rc=$?
echo "test exit $test_rc"; tail -5 "$OUT/test.log"
"$BIN" --bench > "$OUT/bench.log" 2>&1; echo "bench exit $?"
grep -v '^JSON' "$OUT/bench.log"
if command -v python3 > /dev/null; then
  timeout 240 python3 scripts/cuda_sdpa_peer.py > "$OUT/peer.log" 2>&1; echo "peer exit $?"
  cat "$OUT/peer.log" | tail -20
fi
exit $test_rc
