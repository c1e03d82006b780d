#!/bin/bash
# PageKV's paged decode attention against ggml's CPU flash attention on the
# same shapes, back to back: f16 KV, head_dim 128, ctx 4096, batch 1 and 8,
# heads 32/32, 32/8 and 64/8, 2 threads. ggml reads a contiguous head-major
# cache (its best case); PageKV reads shuffled block tables at block_len 16
# and 128 and, with --peer-layout head-major, the same blocks in order.
#
#   scripts/ggml-attention-peer.sh LLAMA_CPP_DIR [ROUNDS]
#
# LLAMA_CPP_DIR: a llama.cpp checkout built beside the project (never
# inside it) with `cmake -B build -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON`
# and `cmake --build build --target llama-bench` (any target that builds
# ggml). The harness, scripts/ggml_attention_peer.cc, is compiled against
# its headers and static libraries into build/peer/ (LLAMA_COMMIT names the
# commit where the checkout has no .git). Needs `make build`
# first (build/release/bin/pagekv). Prints, per round, each shape's GB/s
# for both and PageKV's ratio to ggml; the raw JSON lines go to
# build/peer/ggml-attention-peer.jsonl.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 LLAMA_CPP_DIR [ROUNDS]" >&2
  exit 2
fi
LLAMA=$(cd "$1" && pwd)
ROUNDS=${2:-3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PAGEKV=$ROOT/build/release/bin/pagekv
OUT=$ROOT/build/peer
mkdir -p "$OUT"
LIBS=()
for lib in libggml.a libggml-cpu.a libggml-base.a; do
  f=$(find "$LLAMA/build" -name "$lib" -print -quit)
  if [ -z "$f" ]; then
    echo "$lib not found under $LLAMA/build: build llama.cpp with -DBUILD_SHARED_LIBS=OFF first" >&2
    exit 2
  fi
  LIBS+=("$f")
done
if [ ! -x "$PAGEKV" ]; then
  echo "$PAGEKV not found: run make build first" >&2
  exit 2
fi
COMMIT=${LLAMA_COMMIT:-$(git -C "$LLAMA" rev-parse --short HEAD 2> /dev/null || echo "unknown (set LLAMA_COMMIT)")}
c++ -O2 -std=c++17 -I"$LLAMA/ggml/include" "$ROOT/scripts/ggml_attention_peer.cc" "${LIBS[@]}" \
  -fopenmp -lpthread -lm -o "$OUT/ggml_attention_peer"
: > "$OUT/ggml-attention-peer.jsonl"
echo "llama.cpp / ggml at $COMMIT; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
for round in $(seq "$ROUNDS"); do
  "$OUT/ggml_attention_peer" --threads 2 --ctx 4096 --batch 1,8 --heads 32/32,32/8,64/8 > "$OUT/ggml.json"
  "$PAGEKV" bench attention --no-scalar --dtype f16 --heads 32/32,32/8,64/8 --ctx 4096 --batch 1,8 \
    --block-len 16,128 --threads 2 --peer-layout head-major --json > "$OUT/pagekv.json"
  cat "$OUT/ggml.json" >> "$OUT/ggml-attention-peer.jsonl"
  python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))' "$OUT/pagekv.json" >> "$OUT/ggml-attention-peer.jsonl"
  python3 - "$OUT/ggml.json" "$OUT/pagekv.json" "$round" << 'EOF'
import json, sys
ggml = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    ggml[(r["q_heads"], r["kv_heads"], r["batch"])] = r
pk = json.load(open(sys.argv[2]))
print(f"round {sys.argv[3]}: stream probe {pk['stream_read_gbps']:.1f} GB/s")
print("heads  batch  ggml GB/s (err)   | PageKV bl16 GB/s, x ggml | bl128 GB/s, x ggml | in order bl16, bl128")
rows = {}
for r in pk["results"]:
    rows.setdefault((r["q_heads"], r["kv_heads"], r["batch"]), {})[r["block_len"]] = r
for key in sorted(rows, key=lambda k: (-k[0] // k[1], k[0], k[2])):
    g = ggml.get(key)
    if g is None:
        continue
    b16, b128 = rows[key].get(16), rows[key].get(128)
    def cell(r):
        return f"{r['gbps']:5.1f}, {r['gbps'] / g['gbps']:.2f}x" if r else "-"
    def order(r):
        return f"{r['kv_bytes'] / r['head_major_seconds'] / 1e9:.1f}" if r and r.get("head_major_seconds") else "-"
    print(f"{key[0]}/{key[1]:<3} {key[2]:>5}  {g['gbps']:5.1f} ({g['max_abs_error']:.1e}) | {cell(b16):>17} | {cell(b128):>17} | {order(b16)}, {order(b128)}")
EOF
done
