#include "pagekv/kv_layout.h"

#include <string>

#include "base/checked_math.h"

namespace pagekv {
namespace {

constexpr int32_t kMinBlockLen = 8;
constexpr int32_t kMaxBlockLen = 1024;
// Per-dimension sanity bounds: far above any real model, low enough that a
// typo (an extra zero or two) is caught with a message instead of an
// allocation failure later.
constexpr int32_t kMaxLayers = 4096;
constexpr int32_t kMaxHeads = 65536;
constexpr int32_t kMaxRowElems = 1 << 20;

Status FieldError(std::string_view field, int64_t value, std::string_view accepted) {
  return InvalidArgumentError(std::string(field) + " = " + std::to_string(value) + ": " +
                              std::string(accepted));
}

Status CheckRange(std::string_view field, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    return FieldError(field, value,
                      "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return Status::Ok();
}

}  // namespace

std::string_view AttentionKindName(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::kMha: return "MHA";
    case AttentionKind::kGqa: return "GQA";
    case AttentionKind::kMqa: return "MQA";
    case AttentionKind::kMla: return "MLA";
  }
  return "?";
}

int64_t FormatRowBytes(const KvFormat& format, int64_t elems) {
  const int64_t bits = DTypeBits(format.dtype);
  auto payload_bits = CheckedMul(elems, bits);
  if (!payload_bits) return -1;
  int64_t bytes = CeilDiv(*payload_bits, 8);
  if (format.scale_axis == ScaleAxis::kPerToken) {
    const int64_t groups = CeilDiv(elems, format.group_size);
    auto scale_bytes = CheckedMul(groups, DTypeBits(format.scale_dtype) / 8);
    if (!scale_bytes) return -1;
    auto sum = CheckedAdd(bytes, *scale_bytes);
    if (!sum) return -1;
    bytes = *sum;
  }
  return bytes;
}

AttentionKind CacheConfig::attention_kind() const {
  if (kind == CacheKind::kMla) return AttentionKind::kMla;
  if (num_q_heads == num_kv_heads) return AttentionKind::kMha;
  if (num_kv_heads == 1) return AttentionKind::kMqa;
  return AttentionKind::kGqa;
}

Status CacheConfig::Validate() const {
  PAGEKV_RETURN_IF_ERROR(CheckRange("num_layers", num_layers, 1, kMaxLayers));
  PAGEKV_RETURN_IF_ERROR(CheckRange("num_q_heads", num_q_heads, 1, kMaxHeads));
  if (kind == CacheKind::kPerHead) {
    PAGEKV_RETURN_IF_ERROR(CheckRange("num_kv_heads", num_kv_heads, 1, kMaxHeads));
    PAGEKV_RETURN_IF_ERROR(CheckRange("head_dim", head_dim, 1, kMaxRowElems));
    if (num_q_heads % num_kv_heads != 0) {
      return InvalidArgumentError(
          "num_q_heads = " + std::to_string(num_q_heads) + " is not a multiple of num_kv_heads = " +
          std::to_string(num_kv_heads) +
          ": each KV head must serve the same number of query heads (MHA: equal, GQA: a "
          "divisor, MQA: 1 KV head)");
    }
    if (kv_lora_rank != 0 || rope_dim != 0) {
      return InvalidArgumentError(
          "kv_lora_rank / rope_dim are set but kind is per-head: set kind = MLA to store a "
          "latent cache, or leave them 0");
    }
  } else {
    PAGEKV_RETURN_IF_ERROR(CheckRange("kv_lora_rank", kv_lora_rank, 1, kMaxRowElems));
    PAGEKV_RETURN_IF_ERROR(CheckRange("rope_dim", rope_dim, 0, kMaxRowElems));
    PAGEKV_RETURN_IF_ERROR(CheckRange("head_dim", head_dim, 0, kMaxRowElems));
  }
  if (!IsPowerOfTwo(block_len) || block_len < kMinBlockLen || block_len > kMaxBlockLen) {
    return FieldError("block_len", block_len,
                      "must be a power of two in [8, 1024] (8, 16, 32, 64, 128, 256, 512, 1024)");
  }
  switch (format.scale_axis) {
    case ScaleAxis::kNone:
      if (!format.IsPlainFloat()) {
        return InvalidArgumentError("dtype " + std::string(DTypeName(format.dtype)) +
                                    " needs scales: set a scale axis and group size");
      }
      break;
    case ScaleAxis::kPerToken:
      if (format.dtype == DType::kF32 || format.dtype == DType::kF16 ||
          format.dtype == DType::kBF16) {
        return InvalidArgumentError("scales apply only to fp8, int8 and int4 formats");
      }
      PAGEKV_RETURN_IF_ERROR(CheckRange("group_size", format.group_size, 1, kMaxRowElems));
      if (DTypeBits(format.scale_dtype) < 16) {
        return InvalidArgumentError("scale_dtype must be f32, f16 or bf16");
      }
      break;
    case ScaleAxis::kPerChannel:
      return UnimplementedError(
          "per-channel (token-group) scales are not laid out yet; use a plain f32, f16 or bf16 "
          "format");
  }
  if ((num_blocks > 0) == (budget_bytes > 0)) {
    if (num_blocks < 0) return FieldError("num_blocks", num_blocks, "must be positive");
    if (budget_bytes < 0) return FieldError("budget_bytes", budget_bytes, "must be positive");
    return InvalidArgumentError(
        num_blocks > 0 ? "both num_blocks and budget_bytes are set: give exactly one"
                       : "pool size missing: set num_blocks (> 0) or budget_bytes (> 0)");
  }
  if (num_blocks < 0) return FieldError("num_blocks", num_blocks, "must be positive");
  if (budget_bytes < 0) return FieldError("budget_bytes", budget_bytes, "must be positive");
  // Block ids are int32; keep one id free of the range for sentinels.
  if (num_blocks > (int64_t{1} << 31) - 2) {
    return FieldError("num_blocks", num_blocks, "must be at most 2^31 - 2 (block ids are 32-bit)");
  }
  return Status::Ok();
}

Result<KvLayout> KvLayout::Create(const CacheConfig& config) {
  PAGEKV_RETURN_IF_ERROR(config.Validate());
  KvLayout l;
  l.config_ = config;
  const bool mla = config.kind == CacheKind::kMla;
  l.num_planes_ = mla ? 1 : 2;
  l.num_heads_ = mla ? 1 : config.num_kv_heads;
  l.row_elems_ = mla ? config.kv_lora_rank + config.rope_dim : config.head_dim;
  l.row_bytes_ = FormatRowBytes(config.format, l.row_elems_);

  const auto too_big = [&](std::string_view what) {
    return InvalidArgumentError(std::string(what) +
                                " overflows 63 bits: the geometry is far beyond any real model; "
                                "check num_layers, num_kv_heads, head_dim and num_blocks");
  };
  if (l.row_bytes_ < 0) return too_big("row size");
  auto slab = CheckedMul(l.row_bytes_, config.block_len);
  if (!slab) return too_big("block size");
  l.slab_bytes_ = *slab;
  l.slab_stride_ = RoundUp(l.slab_bytes_, kSlabAlignment);
  auto slabs = CheckedProduct({config.num_layers, l.num_planes_, l.num_heads_});
  if (!slabs) return too_big("slab count");
  l.slabs_per_block_ = *slabs;
  auto per_block = CheckedMul(l.slabs_per_block_, l.slab_stride_);
  auto per_token = CheckedMul(l.slabs_per_block_, l.row_bytes_);
  if (!per_block || !per_token) return too_big("bytes per block");
  l.bytes_per_block_ = *per_block;
  l.bytes_per_token_ = *per_token;

  if (config.num_blocks > 0) {
    l.num_blocks_ = config.num_blocks;
  } else {
    l.num_blocks_ = config.budget_bytes / l.bytes_per_block_;
    if (l.num_blocks_ == 0) {
      return InvalidArgumentError(
          "budget_bytes = " + std::to_string(config.budget_bytes) +
          " is smaller than one block (" + std::to_string(l.bytes_per_block_) +
          " bytes): raise the budget, or shrink the block (smaller block_len or dtype)");
    }
    if (l.num_blocks_ > (int64_t{1} << 31) - 2) l.num_blocks_ = (int64_t{1} << 31) - 2;
  }
  auto head = CheckedMul(l.num_blocks_, l.slab_stride_);
  if (!head) return too_big("arena size");
  l.head_stride_ = *head;
  auto plane = CheckedMul(l.head_stride_, l.num_heads_);
  if (!plane) return too_big("arena size");
  l.plane_stride_ = *plane;
  auto layer = CheckedMul(l.plane_stride_, l.num_planes_);
  if (!layer) return too_big("arena size");
  l.layer_stride_ = *layer;
  auto total = CheckedMul(l.layer_stride_, config.num_layers);
  if (!total) return too_big("arena size");
  l.total_bytes_ = *total;
  return l;
}

}  // namespace pagekv
