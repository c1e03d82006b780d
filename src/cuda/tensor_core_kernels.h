// The kernels on the tensor cores, launched by PagedDecodeAttention and
// PagedPrefillAttention when their params ask for them and the shape allows
// (TensorCoreDecodeShape, TensorCorePrefillShape): decode in
// tensor_core_decode.cu, prefill in tensor_core_prefill.cu. Internal to the
// CUDA kernels.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/paged_attention.h"

namespace pagekv::cuda {

// One CTA per (KV head, sequence, split) over grid (kv_heads, num_seqs,
// splits). With one split part_acc and part_ml are null and the kernel
// writes p.out; otherwise each split leaves its unnormalised accumulator in
// part_acc[((seq * q_heads + head) * splits + split) * head_dim + j] and its
// (max, sum) in part_ml[((seq * q_heads + head) * splits + split) * 2], for
// the merge kernel.
cudaError_t LaunchTensorCoreDecode(const DecodeParams& p, int32_t splits, int32_t tokens_per_split, float* part_acc,
                                   float* part_ml, cudaStream_t stream);

// Prefill and chunked prefill: grid (kv_heads, num_seqs, tiles of 64 rows).
cudaError_t LaunchTensorCorePrefill(const PrefillParams& p, cudaStream_t stream);

}  // namespace pagekv::cuda
