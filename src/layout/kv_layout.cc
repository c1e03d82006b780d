#include "pagekv/kv_layout.h"

#include <charconv>
#include <string>
#include <system_error>
#include <vector>

#include "base/check.h"
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

Status ValidateFormat(const KvFormat& f, const std::string& what) {
  switch (f.scale_axis) {
    case ScaleAxis::kNone:
      if (!f.IsPlainFloat()) {
        return InvalidArgumentError(what + ": dtype " + std::string(DTypeName(f.dtype)) +
                                    " needs scales: set a scale axis and group size");
      }
      break;
    case ScaleAxis::kPerToken:
      if (f.dtype == DType::kF32 || f.dtype == DType::kF16 ||
          f.dtype == DType::kBF16) {
        return InvalidArgumentError(what + ": scales apply only to fp8, int8 and int4 formats");
      }
      PAGEKV_RETURN_IF_ERROR(CheckRange("group_size", f.group_size, 1, kMaxRowElems));
      if (DTypeBits(f.scale_dtype) < 16) {
        return InvalidArgumentError(what + ": scale_dtype must be f32, f16 or bf16");
      }
      break;
    case ScaleAxis::kPerChannel:
      return UnimplementedError(
          "per-channel (token-group) scales are not laid out yet; use a plain f32, f16 or bf16 "
          "format");
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
  PAGEKV_RETURN_IF_ERROR(ValidateFormat(format, "format"));
  if (!layer_formats.empty()) {
    if (static_cast<int64_t>(layer_formats.size()) != num_layers) {
      return InvalidArgumentError("layer_formats has " + std::to_string(layer_formats.size()) +
                                  " entries for " + std::to_string(num_layers) +
                                  " layers: give one per layer, or none to use `format` everywhere");
    }
    for (size_t l = 0; l < layer_formats.size(); ++l) {
      PAGEKV_RETURN_IF_ERROR(ValidateFormat(layer_formats[l], "layer " + std::to_string(l) + " format"));
    }
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

  const auto too_big = [&](std::string_view what) {
    return InvalidArgumentError(std::string(what) +
                                " overflows 63 bits: the geometry is far beyond any real model; "
                                "check num_layers, num_kv_heads, head_dim and num_blocks");
  };
  // Per layer: row and slab sizes; block and token totals over every slab.
  const int64_t slabs_per_layer = int64_t{l.num_planes_} * l.num_heads_;
  l.layers_.resize(static_cast<size_t>(config.num_layers));
  for (int32_t i = 0; i < config.num_layers; ++i) {
    Layer& L = l.layers_[static_cast<size_t>(i)];
    L.row_bytes = FormatRowBytes(config.FormatOf(i), l.row_elems_);
    if (L.row_bytes < 0) return too_big("row size");
    auto slab = CheckedMul(L.row_bytes, config.block_len);
    if (!slab) return too_big("block size");
    L.slab_bytes = *slab;
    L.slab_stride = RoundUp(L.slab_bytes, kSlabAlignment);
    auto per_block = CheckedMul(slabs_per_layer, L.slab_stride);
    auto per_token = CheckedMul(slabs_per_layer, L.row_bytes);
    if (!per_block || !per_token) return too_big("bytes per block");
    auto block_sum = CheckedAdd(l.bytes_per_block_, *per_block);
    auto token_sum = CheckedAdd(l.bytes_per_token_, *per_token);
    if (!block_sum || !token_sum) return too_big("bytes per block");
    l.bytes_per_block_ = *block_sum;
    l.bytes_per_token_ = *token_sum;
    l.padding_bytes_per_block_ += slabs_per_layer * (L.slab_stride - L.slab_bytes);
    const KvFormat& a = config.FormatOf(i);
    const KvFormat& b = config.FormatOf(0);
    if (a.dtype != b.dtype || a.scale_axis != b.scale_axis || a.group_size != b.group_size ||
        a.scale_dtype != b.scale_dtype) {
      l.uniform_ = false;
    }
  }
  l.slabs_per_block_ = slabs_per_layer * config.num_layers;

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
  // Strides: [layer][plane][head][block], each layer sized by its own slabs.
  int64_t offset = 0;
  for (Layer& L : l.layers_) {
    auto head = CheckedMul(l.num_blocks_, L.slab_stride);
    if (!head) return too_big("arena size");
    L.head_stride = *head;
    auto plane = CheckedMul(L.head_stride, l.num_heads_);
    if (!plane) return too_big("arena size");
    L.plane_stride = *plane;
    auto layer = CheckedMul(L.plane_stride, l.num_planes_);
    if (!layer) return too_big("arena size");
    L.offset = offset;
    auto next = CheckedAdd(offset, *layer);
    if (!next) return too_big("arena size");
    offset = *next;
  }
  l.total_bytes_ = offset;
  return l;
}

namespace {

const char kUniformOnly[] =
    "this KvLayout accessor is for layouts whose layers share one format; use the per-layer overload";

}  // namespace

int64_t KvLayout::row_bytes() const {
  PAGEKV_CHECK_MSG(uniform_, kUniformOnly);
  return layers_[0].row_bytes;
}
int64_t KvLayout::slab_bytes() const {
  PAGEKV_CHECK_MSG(uniform_, kUniformOnly);
  return layers_[0].slab_bytes;
}
int64_t KvLayout::slab_stride() const {
  PAGEKV_CHECK_MSG(uniform_, kUniformOnly);
  return layers_[0].slab_stride;
}
int64_t KvLayout::head_stride() const {
  PAGEKV_CHECK_MSG(uniform_, kUniformOnly);
  return layers_[0].head_stride;
}
int64_t KvLayout::plane_stride() const {
  PAGEKV_CHECK_MSG(uniform_, kUniformOnly);
  return layers_[0].plane_stride;
}
int64_t KvLayout::layer_stride() const {
  PAGEKV_CHECK_MSG(uniform_, kUniformOnly);
  return layers_[0].plane_stride * num_planes_;
}

Result<std::vector<KvFormat>> ParseLayerFormats(std::string_view spec, int32_t num_layers, int32_t row_elems,
                                                const KvFormat& base) {
  std::vector<KvFormat> out;
  if (spec.empty()) return out;
  out.assign(static_cast<size_t>(num_layers), base);
  std::vector<char> given(static_cast<size_t>(num_layers), 0);
  auto parse_layer = [&](std::string_view t, const std::string& entry) -> Result<int32_t> {
    int64_t v = 0;
    const auto [ptr, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    if (ec != std::errc() || ptr != t.data() + t.size()) {
      return InvalidArgumentError("layer formats: '" + entry + "': '" + std::string(t) + "' is not a layer index");
    }
    if (v < 0) v += num_layers;
    if (v < 0 || v >= num_layers) {
      return InvalidArgumentError("layer formats: '" + entry + "': layer " + std::string(t) + " is outside the model's " +
                                  std::to_string(num_layers) + " layers (0.." + std::to_string(num_layers - 1) +
                                  ", or -1 for the last)");
    }
    return static_cast<int32_t>(v);
  };
  size_t start = 0;
  while (start <= spec.size()) {
    const size_t comma = spec.find(',', start);
    const std::string_view item = spec.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    const std::string entry(item);
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) {
      return InvalidArgumentError("layer formats: '" + entry + "' lacks '=': write LAYERS=DTYPE, e.g. 0=f16,-1=f16");
    }
    const std::string_view layers = item.substr(0, eq);
    PAGEKV_ASSIGN_OR_RETURN(DType d, ParseDType(item.substr(eq + 1)));
    const size_t colon = layers.find(':', 1);  // a leading '-' is a sign, not a range
    PAGEKV_ASSIGN_OR_RETURN(int32_t first, parse_layer(layers.substr(0, colon), entry));
    int32_t last = first;
    if (colon != std::string_view::npos) {
      PAGEKV_ASSIGN_OR_RETURN(last, parse_layer(layers.substr(colon + 1), entry));
    }
    if (last < first) return InvalidArgumentError("layer formats: '" + entry + "': the range runs backwards");
    for (int32_t i = first; i <= last; ++i) {
      if (given[static_cast<size_t>(i)] != 0) {
        return InvalidArgumentError("layer formats: layer " + std::to_string(i) + " is given twice ('" + entry + "')");
      }
      given[static_cast<size_t>(i)] = 1;
      out[static_cast<size_t>(i)] = KvFormat::ForDType(d, row_elems);
    }
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

}  // namespace pagekv
