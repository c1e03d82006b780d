#!/bin/bash
# The GPU checks, for a machine with an NVIDIA GPU and the CUDA toolkit but
# none of the project's other dependencies: builds the CUDA kernels' tests
# with nvcc alone, runs them (every case against the double reference; the
# KV store against the host encoders, byte for byte), then
# the benchmark (the device's streaming read bandwidth and each decode
# shape's share of it) and the PyTorch peer on the same shapes. Output under
# $OUT (default build/cuda-check): build.log, test.log, store-test.log, bench.log,
# peer.log.
set -u
OUT=${OUT:-build/cuda-check}
mkdir -p "$OUT"
TMP=$(mktemp -d)
BIN=$TMP/paged_attention_test
STORE_BIN=$TMP/kv_store_test
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$OUT/device.txt" 2>&1
nvcc --version >> "$OUT/device.txt" 2>&1
if ! nvcc -O3 -std=c++17 -lineinfo -gencode arch=compute_90,code=sm_90 -Xptxas -v -Isrc \
    src/cuda/paged_attention.cu src/cuda/paged_attention_test.cu -o "$BIN" > "$OUT/build.log" 2>&1; then
  echo "build failed"; tail -30 "$OUT/build.log"; exit 1
fi
# The KV store test compares bytes with the host's encoders (plain C++ from
# the layout module, compiled here by nvcc's host compiler).
if ! nvcc -O3 -std=c++17 -lineinfo -gencode arch=compute_90,code=sm_90 -Isrc \
    src/cuda/kv_store.cu src/cuda/paged_attention.cu src/cuda/kv_store_test.cu src/layout/quantize.cc \
    -o "$STORE_BIN" >> "$OUT/build.log" 2>&1; then
  echo "build failed (kv store test)"; tail -30 "$OUT/build.log"; exit 1
fi
"$BIN" > "$OUT/test.log" 2>&1; test_rc=$?
echo "test exit $test_rc"; tail -5 "$OUT/test.log"
"$STORE_BIN" > "$OUT/store-test.log" 2>&1; store_rc=$?
echo "kv store test exit $store_rc"; tail -8 "$OUT/store-test.log"
[ $test_rc -eq 0 ] && test_rc=$store_rc
"$BIN" --bench > "$OUT/bench.log" 2>&1; echo "bench exit $?"
grep -v '^JSON' "$OUT/bench.log"
if command -v python3 > /dev/null; then
  timeout 240 python3 scripts/cuda_sdpa_peer.py > "$OUT/peer.log" 2>&1; echo "peer exit $?"
  cat "$OUT/peer.log" | tail -20
fi
exit $test_rc
