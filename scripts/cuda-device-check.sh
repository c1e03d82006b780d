#!/bin/bash
# The GPU checks, for a machine with an NVIDIA GPU and the CUDA toolkit but
# none of the project's other dependencies: builds the CUDA kernels' tests
# with nvcc alone, runs them (every case against the double reference; the
# KV store against the host encoders, byte for byte), then
# the benchmark (the device's streaming read bandwidth and each decode
# shape's share of it) and the PyTorch peer on the same shapes; then, where
# the project's dependencies are installed, the CUDA backend's tests and
# generation on the device. Output under $OUT (default build/cuda-check):
# build.log, test.log (decode and prefill), store-test.log, bench.log,
# peer.log, full-*.log, backend-test.log, device-generate.log,
# bench-attention.txt, bench-attention-tc.txt, bench-generate-{cuda,cpu}.txt,
# bench-generate-graphs.txt (without and with --cuda-graphs).
#
# PARTS (default "kernels peer backend") picks what runs, to fit a lease (a
# command may run 10 minutes: give "kernels backend" one call, "peer" the next):
# kernels (nvcc-only tests and --bench), peer (PyTorch SDPA), backend (the
# carried or built project: backend tests, device generation, bench attention).
set -u
PARTS=${PARTS:-kernels peer backend}
want() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
OUT=${OUT:-build/cuda-check}
mkdir -p "$OUT"
test_rc=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$OUT/device.txt" 2>&1
nvcc --version >> "$OUT/device.txt" 2>&1
if want kernels; then
  TMP=$(mktemp -d)
  BIN=$TMP/paged_attention_test
  STORE_BIN=$TMP/kv_store_test
  if ! nvcc -O3 -std=c++17 -lineinfo -gencode arch=compute_90,code=sm_90 -Xptxas -v -Isrc \
      src/cuda/paged_attention.cu src/cuda/tensor_core_decode.cu src/cuda/tensor_core_prefill.cu src/cuda/paged_attention_test.cu -lcublas -o "$BIN" > "$OUT/build.log" 2>&1; then
    echo "build failed"; tail -30 "$OUT/build.log"; exit 1
  fi
  # The KV store test compares bytes with the host's encoders (plain C++ from
  # the layout module, compiled here by nvcc's host compiler).
  if ! nvcc -O3 -std=c++17 -lineinfo -gencode arch=compute_90,code=sm_90 -Isrc \
      src/cuda/kv_store.cu src/cuda/paged_attention.cu src/cuda/tensor_core_decode.cu src/cuda/tensor_core_prefill.cu src/cuda/kv_store_test.cu src/layout/quantize.cc \
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
fi
if want peer && command -v python3 > /dev/null; then
  timeout 240 python3 scripts/cuda_sdpa_peer.py > "$OUT/peer.log" 2>&1; echo "peer exit $?"
  cat "$OUT/peer.log" | tail -20
fi
# The CUDA backend behind the Backend seam (every call against the CPU
# backend) and generation on the device against the CPU need the whole
# project. Either carried, built on the development machine
# (scripts/cuda-carry.sh packs build/device/carry.tar.xz: name build/device
# in the run's carry), or built here where CMake finds the project's Debian
# dependencies; where neither, say so.
run_full() {  # $1: the folder with bin/ (the tests run from $1/repo, so ../shared is the carried data)
  local dir="$1"
  (cd "$dir/repo" && "$dir/bin/pagekv_cuda_backend_test") > "$OUT/backend-test.log" 2>&1; backend_rc=$?
  echo "backend test exit $backend_rc"; tail -5 "$OUT/backend-test.log"
  (cd "$dir/repo" && "$dir/bin/pagekv_engine_test" --gtest_filter='DeviceGenerateTest.*:GpuGenerateTest.*') \
    > "$OUT/device-generate.log" 2>&1; generate_rc=$?
  echo "device generate tests exit $generate_rc"; tail -8 "$OUT/device-generate.log"
  # The paged decode grid through the backend, against the device's read
  # bandwidth measured in the same run (rows as `pagekv bench attention`'s).
  timeout 240 "$dir/bin/pagekv" bench attention --device cuda --no-scalar --peer-layout head-major \
    --batch 8 --ctx 4096,16384 --heads 32/32,32/8,64/8 --dtype f16,bf16 --block-len 16,128 \
    > "$OUT/bench-attention.txt" 2>&1; echo "bench attention --device cuda exit $?"
  tail -40 "$OUT/bench-attention.txt"
  # The same GQA shapes through the tensor-core decode kernel (--tensor-cores).
  timeout 180 "$dir/bin/pagekv" bench attention --device cuda --tensor-cores --no-scalar --peer-layout head-major \
    --batch 8 --ctx 4096,16384 --heads 32/8,64/8 --dtype f16,bf16 --block-len 16,128 \
    > "$OUT/bench-attention-tc.txt" 2>&1; echo "bench attention --device cuda --tensor-cores exit $?"
  tail -20 "$OUT/bench-attention-tc.txt"
  # Whole-model generation on the GPU (the synthetic llama-110m, f16), then
  # the same on this machine's CPUs, for the ratio.
  for dev in cuda cpu; do
    timeout 120 "$dir/bin/pagekv" bench generate --device $dev --batch 1,8,32 --prompt-len 128 --steps 32 \
      > "$OUT/bench-generate-$dev.txt" 2>&1; echo "bench generate --device $dev exit $?"
    tail -5 "$OUT/bench-generate-$dev.txt"
  done
  # The decode steps as CUDA graphs (--cuda-graphs), beside the run above:
  # the small model, where launches dominate, and the synthetic llama-110m.
  for model in "--model ../shared/models/stories260K/stories260K.gguf" ""; do
    for graphs in "" --cuda-graphs; do
      (cd "$dir/repo" && timeout 90 "$dir/bin/pagekv" bench generate --device cuda $graphs $model --batch 1,8 \
        --prompt-len 128 --steps 64) >> "$OUT/bench-generate-graphs.txt" 2>&1
      echo "bench generate --device cuda $graphs ${model:+(stories260K)} exit $?"
    done
  done
  tail -20 "$OUT/bench-generate-graphs.txt"
  [ $test_rc -eq 0 ] && test_rc=$backend_rc
  [ $test_rc -eq 0 ] && test_rc=$generate_rc
}
if ! want backend; then
  :
elif [ -f build/device/carry.tar.xz ]; then
  CARRY=$(mktemp -d)
  tar -C "$CARRY" -xJf build/device/carry.tar.xz
  # The carried libraries, then CUDA's wherever this machine has them.
  cuda_libs=""
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d "$d" ] && cuda_libs="$cuda_libs:$d"; done
  for m in cublas cuda_runtime; do
    d=$(python3 -c "import nvidia.$m, os; print(os.path.join(list(nvidia.$m.__path__)[0], 'lib'))" 2>/dev/null) &&
      [ -d "$d" ] && cuda_libs="$cuda_libs:$d"
  done
  export LD_LIBRARY_PATH="$CARRY/lib$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  LD_BIND_NOW=1 "$CARRY/bin/pagekv" --version > "$OUT/carry-load.log" 2>&1 || { echo "the carried binaries do not load:"; cat "$OUT/carry-load.log"; }
  run_full "$CARRY"
elif cmake -S . -B build/cuda-full -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGEKV_CUDA=ON -DPAGEKV_BUILD_BENCHMARKS=OFF \
    -DCMAKE_CUDA_ARCHITECTURES=90-real > "$OUT/full-config.log" 2>&1 &&
    timeout 420 cmake --build build/cuda-full --target pagekv_cuda_backend_test pagekv_engine_test pagekv_cli \
      > "$OUT/full-build.log" 2>&1; then
  # The built tree laid out as the carry is: bin/, and repo/ beside ../shared.
  FULL=$(mktemp -d)
  mkdir -p "$FULL/bin"
  ln -s "$PWD" "$FULL/repo"
  for f in src/cuda/pagekv_cuda_backend_test src/engine/pagekv_engine_test bin/pagekv; do ln -sf "$PWD/build/cuda-full/$f" "$FULL/bin/"; done
  run_full "$FULL"
else
  echo "the project's dependencies are not all here: the CUDA backend and device generation tests were not built"
  tail -5 "$OUT/full-config.log" "$OUT/full-build.log" 2>/dev/null
fi
exit $test_rc
