// Paged decode attention on NVIDIA GPUs (CUDA), reading the KV cache in the
// byte layout of docs/KV_LAYOUT.md: the cache of one layer is two planes (K,
// V); the rows of token slot s of block b for KV head h start at
//   plane_base + h * head_stride + b * slab_stride + s * row_bytes,
// so a device arena holding the same bytes as the host arena is read with
// the same block ids and tables. Flash-decoding: each (sequence, KV head)
// is split over `splits` ranges of blocks, each CTA serves every query head
// of its group (one read of a K / V row for G heads), and a merge kernel
// combines the splits by their log-sum-exps.
//
// This header needs only the CUDA runtime (no other project library), so
// the kernels' test and benchmark build on a machine with the CUDA toolkit
// alone (scripts/cuda-device-check.sh).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace pagekv::cuda {

// Row formats (docs/KV_LAYOUT.md). The 8-bit ones end each row with its f16
// scale: row = [head_dim codes][f16 s]; int8 codes are q with x = q s, fp8
// codes are E4M3 / E5M2 values with x = value s.
enum class KvType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kInt8 = 3, kFp8E4M3 = 4, kFp8E5M2 = 5 };

// Bytes of one element, and whether a row carries a trailing f16 scale.
constexpr int32_t ElementBytes(KvType t) { return t == KvType::kF32 ? 4 : t == KvType::kF16 || t == KvType::kBF16 ? 2 : 1; }
constexpr bool ScaledRows(KvType t) { return ElementBytes(t) == 1; }
// The bytes a row needs (the arena may space rows further apart).
constexpr int64_t RowBytesNeeded(KvType t, int32_t head_dim) {
  return static_cast<int64_t>(head_dim) * ElementBytes(t) + (ScaledRows(t) ? 2 : 0);
}

struct DecodeParams {
  KvType type = KvType::kF16;
  int32_t num_seqs = 0;
  int32_t q_heads = 0, kv_heads = 0;  // q_heads a multiple of kv_heads; G = q_heads / kv_heads <= 16
  int32_t head_dim = 0;               // a multiple of 8 (16-byte rows of f16), up to 256
  int32_t block_len = 0;
  // Device pointers.
  const void* k_plane = nullptr;  // K rows of KV head 0, block 0, slot 0 of the layer
  const void* v_plane = nullptr;
  // Bytes. f32 / f16 / bf16: multiples of 16 (16-byte loads); the 8-bit
  // formats: multiples of 2 (their rows are head_dim + 2 bytes apart).
  int64_t head_stride = 0, slab_stride = 0, row_bytes = 0;
  const int32_t* block_tables = nullptr;  // [num_seqs][max_blocks]
  int32_t max_blocks = 0;
  const int32_t* context_lens = nullptr;  // [num_seqs]
  const float* q = nullptr;               // [num_seqs][q_heads][head_dim]
  float* out = nullptr;                   // [num_seqs][q_heads][head_dim]
  float scale = 0;                        // 0: 1 / sqrt(head_dim)
  // Flash-decoding: blocks per split (0: chosen from the shape); scratch of
  // ScratchBytes() bytes (device), or null to launch one split only.
  int32_t blocks_per_split = 0;
  void* scratch = nullptr;
  // head_dim / 8 a power of two: the kernel whose threads own 16-byte
  // chunks of a row (false: the general one, for comparison and tests).
  bool use_chunk_kernel = true;
  // f16 / bf16 rows, head_dim a multiple of 16 up to 128: the tensor-core
  // kernel (TensorCoreDecodeShape); other shapes take the CUDA-core ones.
  bool tensor_cores = false;
};

// Splits the launch uses for `p` (p.blocks_per_split, or chosen so the GPU
// has a few CTAs per multiprocessor), and the scratch they need.
int32_t Splits(const DecodeParams& p, int32_t longest_context, int32_t multiprocessors);
size_t ScratchBytes(const DecodeParams& p, int32_t splits);

// Runs the decode attention on `stream`. Errors: a shape outside the
// limits above (cudaErrorInvalidValue), or the launch's error.
cudaError_t PagedDecodeAttention(const DecodeParams& p, int32_t splits, cudaStream_t stream);

// Whether decode `p` can take the tensor-core kernel: f16 or bf16 rows,
// head_dim a multiple of 16 and at most 128, rows 16-byte aligned. That
// kernel (tensor_core_decode.cu) puts the group's G query heads, padded to
// 16, in the M dimension of WMMA 16x16x16 tiles: S = Q K^T and O += P V on
// the tensor cores with Q and P split into 16-bit parts (hi + lo for f16,
// hi + mid + lo for bf16) so that the products keep about f32's precision,
// K and V exact; the softmax in f32 over phases of 256 keys; the same
// splits and merge as the CUDA-core kernels. For GQA, where those need
// 4 G fp32 flops per element read.
bool TensorCoreDecodeShape(const DecodeParams& p);

// Prefill and chunked-prefill attention, causal, reading every cached
// position (the prompt's earlier chunks and any shared prefix) through the
// block table. Sequence i's last query_lens[i] of context_lens[i] cached
// positions are its queries: query j sits at position
// p = context_lens[i] - query_lens[i] + j and attends to [lo, p], lo = 0
// or, with a window w > 0, max(0, p - w + 1). Its rows are
// query_starts[i] + j of q and out.
//
// What decode's fast kernel does not do is here too, so a decode step that
// needs it runs as prefill with one query per sequence: sliding windows,
// logit soft-capping, the rows' log-sum-exps, and partial tables (context
// parallel: a negative table entry is a block held elsewhere; its positions
// are skipped, and a row that read no position gets out 0, lse -inf).
//
// One CTA per (KV head, sequence, tile of 16 rows: 16 / G queries times the
// G query heads of the KV head), keys in tiles of 32 decoded once into
// shared memory and read by every row of the CTA; one warp per row at a
// time, a lane per key for the scores and per dimension for P.V; online
// softmax in f32.
struct PrefillParams {
  KvType type = KvType::kF16;
  int32_t num_seqs = 0;
  int32_t q_heads = 0, kv_heads = 0;  // G = q_heads / kv_heads <= 16
  int32_t head_dim = 0;               // 1..256
  int32_t block_len = 0;
  // Device pointers and byte strides, as in DecodeParams (any row_bytes
  // holding the type's row; rows are read element by element).
  const void* k_plane = nullptr;
  const void* v_plane = nullptr;
  int64_t head_stride = 0, slab_stride = 0, row_bytes = 0;
  const int32_t* block_tables = nullptr;  // [num_seqs][max_blocks]; < 0: not held here
  int32_t max_blocks = 0;
  const int32_t* context_lens = nullptr;  // [num_seqs], each <= max_blocks * block_len
  const int32_t* query_lens = nullptr;    // [num_seqs], each in [0, context_lens[i]]
  const int32_t* query_starts = nullptr;  // [num_seqs]: first row of each sequence in q / out
  const int32_t* windows = nullptr;       // optional [num_seqs]: 0 = every earlier position
  int32_t max_query_len = 0;              // >= every query_lens[i] (the grid's extent)
  const float* q = nullptr;               // [rows][q_heads][head_dim]
  float* out = nullptr;                   // [rows][q_heads][head_dim]
  float* lse = nullptr;                   // optional [rows][q_heads]
  float scale = 0;                        // 0: 1 / sqrt(head_dim)
  float softcap = 0;                      // > 0: logits = softcap * tanh(logits / softcap)
  // f16 / bf16 rows, head_dim a multiple of 16 up to 128: the tensor-core
  // kernel (TensorCorePrefill) instead of the CUDA-core one.
  bool tensor_cores = false;
};

// Errors: a shape outside the limits above (cudaErrorInvalidValue), or the
// launch's error.
cudaError_t PagedPrefillAttention(const PrefillParams& p, cudaStream_t stream);

// Whether `p` can take the tensor-core kernel: f16 or bf16 rows, head_dim a
// multiple of 16 and at most 128, rows 16-byte aligned. That kernel (WMMA
// 16x16x16 tiles, f32 accumulation): one CTA of 4 warps per (KV head,
// sequence, 64 rows of query x group head), keys in tiles of 64 copied
// once into shared memory; S = Q K^T and O += P V on the tensor cores with
// Q and P split into 16-bit parts (hi + lo for f16, hi + mid + lo for bf16)
// so that the products keep about f32's precision with K and V exact; the
// online softmax in f32 on S in shared memory, O accumulated there.
bool TensorCorePrefillShape(const PrefillParams& p);

}  // namespace pagekv::cuda
