#include "pagekv/kv_layout.h"

#include <algorithm>
#include <charconv>
#include <map>
#include <numeric>
#include <string>
#include <system_error>
#include <vector>

#include "base/check.h"
#include "base/checked_math.h"
#include "layout/quantize.h"

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
      if (!f.IsKivi()) {
        return UnimplementedError(what + ": per-channel scales are laid out only for int4 KIVI with f16 scales "
                                  "(KvFormat::Int4Kivi)");
      }
      if (!IsPowerOfTwo(f.group_size) || f.group_size < 8 || f.group_size > 256) {
        return FieldError(what + " group_size", f.group_size, "int4 KIVI groups are a power of two in [8, 256] tokens (32 or 64 usual)");
      }
      break;
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
  for (size_t l = 0; l < std::max<size_t>(1, layer_formats.size()); ++l) {
    const KvFormat& f = layer_formats.empty() ? format : layer_formats[l];
    if (f.hadamard) {
      if (!(f.dtype == DType::kInt8 || f.dtype == DType::kFP8E4M3 || f.dtype == DType::kFP8E5M2) ||
          f.scale_axis != ScaleAxis::kPerToken) {
        return InvalidArgumentError("Hadamard rotation applies to int8 and fp8 rows; " + f.ToString() + " has none");
      }
      const int32_t elems = kind == CacheKind::kMla ? kv_lora_rank + rope_dim : head_dim;
      if (!IsPowerOfTwo(elems)) {
        return InvalidArgumentError("Hadamard rotation needs a power-of-two row length; rows have " +
                                    std::to_string(elems) + " elements: drop the rotation for this model");
      }
      if (kind == CacheKind::kMla) {
        return UnimplementedError("Hadamard rotation is read by the per-head kernels; not for an MLA latent cache");
      }
    }
    if (!f.IsKivi()) continue;
    if (kind == CacheKind::kMla) {
      return UnimplementedError("int4 KIVI stores per-head K and V; an MLA latent cache has neither");
    }
    if (block_len % f.group_size != 0) {
      return InvalidArgumentError("int4 KIVI group of " + std::to_string(f.group_size) +
                                  " tokens does not divide block_len " + std::to_string(block_len) +
                                  ": use a block_len that is a multiple of the group (e.g. " +
                                  std::to_string(std::max(f.group_size, block_len)) + ") or a smaller group");
    }
    if (head_dim % 2 != 0 || head_dim > 512) {
      return InvalidArgumentError("int4 KIVI packs two values per byte and supports head_dim up to 512: head_dim " +
                                  std::to_string(head_dim) + " must be even and at most 512");
    }
  }
  if (!layer_windows.empty()) {
    if (static_cast<int64_t>(layer_windows.size()) != num_layers) {
      return InvalidArgumentError("layer_windows has " + std::to_string(layer_windows.size()) + " entries for " +
                                  std::to_string(num_layers) +
                                  " layers: give one per layer (0 = full attention), or none for a uniform cache");
    }
    if (kind == CacheKind::kMla) {
      return UnimplementedError("layer_windows: sliding-window layers over an MLA latent cache are not supported");
    }
    for (size_t l = 0; l < layer_windows.size(); ++l) {
      const int32_t w = layer_windows[l];
      if (w < 0) return FieldError("layer_windows[" + std::to_string(l) + "]", w, "must be 0 (full attention) or a window > 0");
      if (w > 0 && w < block_len) {
        return InvalidArgumentError("block_len " + std::to_string(block_len) + " does not suit the sliding window of " +
                                    std::to_string(w) + " tokens (layer " + std::to_string(l) +
                                    "): a block longer than the window keeps tokens no query sees; use a block_len of "
                                    "at most " + std::to_string(w) + " (a power of two), or a uniform cache");
      }
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
  // Cache groups: layers of one window, k per group (k = the gcd of the
  // per-window layer counts), full-attention groups first, then sliding ones
  // by window; within a kind, layers in order.
  std::map<int32_t, std::vector<int32_t>> by_window;
  for (int32_t i = 0; i < config.num_layers; ++i) by_window[config.WindowOf(i)].push_back(i);
  int32_t k = 0;
  for (const auto& [w, layers] : by_window) k = std::gcd(k, static_cast<int32_t>(layers.size()));
  l.layers_per_block_ = k;
  l.layers_.resize(static_cast<size_t>(config.num_layers));
  std::vector<int32_t> slot_of(static_cast<size_t>(config.num_layers));
  for (const auto& [w, layers] : by_window) {
    for (size_t j = 0; j < layers.size(); j += static_cast<size_t>(k)) {
      Group g;
      g.window = w;
      g.layers.assign(layers.begin() + static_cast<std::ptrdiff_t>(j), layers.begin() + static_cast<std::ptrdiff_t>(j) + k);
      for (int32_t s = 0; s < k; ++s) {
        l.layers_[static_cast<size_t>(g.layers[static_cast<size_t>(s)])].group = static_cast<int32_t>(l.groups_.size());
        slot_of[static_cast<size_t>(g.layers[static_cast<size_t>(s)])] = s;
      }
      l.groups_.push_back(std::move(g));
    }
  }
  auto same_format = [](const KvFormat& a, const KvFormat& b) {
    return a.dtype == b.dtype && a.scale_axis == b.scale_axis && a.group_size == b.group_size &&
           a.scale_dtype == b.scale_dtype && a.hadamard == b.hadamard;
  };
  const std::vector<int32_t>& slot_layers = l.groups_[0].layers;  // slot s's geometry: this layer's
  for (int32_t i = 0; i < config.num_layers; ++i) {
    const int32_t rep = slot_layers[static_cast<size_t>(slot_of[static_cast<size_t>(i)])];
    if (!same_format(config.FormatOf(i), config.FormatOf(rep))) {
      return InvalidArgumentError(
          "layer_formats: layers " + std::to_string(rep) + " (" + config.FormatOf(rep).ToString() + ") and " +
          std::to_string(i) + " (" + config.FormatOf(i).ToString() + ") share a slot of the hybrid cache's blocks (" +
          std::to_string(l.groups_.size()) + " groups of " + std::to_string(k) +
          " layers) and must share a format: repeat the formats per group, or give every layer one format");
    }
  }
  // Per layer: row and slab sizes; block and token totals over every slab
  // (a block's over the slot layers, a token's over every layer).
  const int64_t slabs_per_layer = int64_t{l.num_planes_} * l.num_heads_;
  bool any_kivi = false;
  for (int32_t i = 0; i < config.num_layers; ++i) {
    Layer& L = l.layers_[static_cast<size_t>(i)];
    const bool in_block = slot_layers[static_cast<size_t>(slot_of[static_cast<size_t>(i)])] == i;
    const KvFormat& f = config.FormatOf(i);
    L.kivi = f.IsKivi();
    int64_t token_bytes = 0;  // this layer's share of bytes_per_token
    if (L.kivi) {
      any_kivi = true;
      L.row_bytes = 2 * int64_t{l.row_elems_};  // f16 rows in and out
      const int64_t groups = config.block_len / f.group_size;
      auto kb = CheckedMul(groups, quant::Int4KeyGroupBytes(f.group_size, l.row_elems_));
      auto vb = CheckedMul(config.block_len, quant::Int4ValueRowBytes(l.row_elems_));
      if (!kb || !vb) return too_big("block size");
      L.slab_bytes[0] = *kb;
      L.slab_bytes[1] = *vb;
      token_bytes = l.num_heads_ * CeilDiv(*kb + *vb, config.block_len);
      L.tail_offset = l.tail_bytes_per_sequence_;
      l.tail_bytes_per_sequence_ += slabs_per_layer * f.group_size * L.row_bytes;
    } else {
      L.row_bytes = FormatRowBytes(f, l.row_elems_);
      if (L.row_bytes < 0) return too_big("row size");
      auto slab = CheckedMul(L.row_bytes, config.block_len);
      if (!slab) return too_big("block size");
      L.slab_bytes[0] = L.slab_bytes[1] = *slab;
      auto per_token = CheckedMul(slabs_per_layer, L.row_bytes);
      if (!per_token) return too_big("bytes per token");
      token_bytes = *per_token;
    }
    int64_t block_bytes = 0, padding = 0;
    for (int32_t p = 0; p < l.num_planes_; ++p) {
      L.slab_stride[p] = RoundUp(L.slab_bytes[p], kSlabAlignment);
      auto plane_block = CheckedMul(int64_t{l.num_heads_}, L.slab_stride[p]);
      if (!plane_block) return too_big("bytes per block");
      block_bytes += *plane_block;
      padding += l.num_heads_ * (L.slab_stride[p] - L.slab_bytes[p]);
    }
    auto token_sum = CheckedAdd(l.bytes_per_token_, token_bytes);
    if (!token_sum) return too_big("bytes per token");
    l.bytes_per_token_ = *token_sum;
    if (in_block) {
      auto block_sum = CheckedAdd(l.bytes_per_block_, block_bytes);
      if (!block_sum) return too_big("bytes per block");
      l.bytes_per_block_ = *block_sum;
      l.bytes_per_block_token_ += token_bytes;
      l.padding_bytes_per_block_ += padding;
    }
    if (!same_format(f, config.FormatOf(0))) l.uniform_ = false;
  }
  if (any_kivi) l.uniform_ = false;
  l.slabs_per_block_ = slabs_per_layer * k;

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
  // Strides: [slot][plane][head][block], each slot and plane sized by its own
  // slabs; every layer takes its slot's offsets.
  int64_t offset = 0;
  for (int32_t s = 0; s < k; ++s) {
    Layer& L = l.layers_[static_cast<size_t>(slot_layers[static_cast<size_t>(s)])];
    L.offset = offset;
    int64_t plane_offset = 0;
    for (int32_t p = 0; p < l.num_planes_; ++p) {
      auto head = CheckedMul(l.num_blocks_, L.slab_stride[p]);
      if (!head) return too_big("arena size");
      L.head_stride[p] = *head;
      auto plane = CheckedMul(L.head_stride[p], l.num_heads_);
      if (!plane) return too_big("arena size");
      L.plane_offset[p] = plane_offset;
      auto next_plane = CheckedAdd(plane_offset, *plane);
      if (!next_plane) return too_big("arena size");
      plane_offset = *next_plane;
    }
    auto next = CheckedAdd(offset, plane_offset);
    if (!next) return too_big("arena size");
    offset = *next;
  }
  for (int32_t i = 0; i < config.num_layers; ++i) {
    Layer& L = l.layers_[static_cast<size_t>(i)];
    const Layer& R = l.layers_[static_cast<size_t>(slot_layers[static_cast<size_t>(slot_of[static_cast<size_t>(i)])])];
    if (&L == &R) continue;
    L.offset = R.offset;
    for (int32_t p = 0; p < 2; ++p) {
      L.head_stride[p] = R.head_stride[p];
      L.plane_offset[p] = R.plane_offset[p];
    }
  }
  l.total_bytes_ = offset;
  return l;
}

namespace {

const char kUniformOnly[] =
    "this KvLayout accessor is for layouts whose layers share one format; use the per-layer overload";

}  // namespace

int64_t KvLayout::BlocksHeld(int64_t tokens, int64_t step_tokens) const {
  const int64_t bl = config_.block_len;
  const int64_t all = CeilDiv(std::max<int64_t>(tokens, 0), bl);
  int64_t total = 0;
  for (const Group& g : groups_) {
    total += g.window == 0 ? all : std::min(all, CeilDiv(g.window - 1 + std::max<int64_t>(step_tokens, 1), bl) + 1);
  }
  return total;
}

int64_t KvLayout::row_bytes() const {
  PAGEKV_CHECK_MSG(uniform_, kUniformOnly);
  return layers_[0].row_bytes;
}
int64_t KvLayout::slab_bytes() const {
  PAGEKV_CHECK_MSG(uniform_, kUniformOnly);
  return layers_[0].slab_bytes[0];
}
int64_t KvLayout::slab_stride() const {
  PAGEKV_CHECK_MSG(uniform_, kUniformOnly);
  return layers_[0].slab_stride[0];
}
int64_t KvLayout::head_stride() const {
  PAGEKV_CHECK_MSG(uniform_, kUniformOnly);
  return layers_[0].head_stride[0];
}
int64_t KvLayout::plane_stride() const {
  PAGEKV_CHECK_MSG(uniform_, kUniformOnly);
  return layers_[0].head_stride[0] * num_heads_;
}
int64_t KvLayout::layer_stride() const {
  PAGEKV_CHECK_MSG(uniform_, kUniformOnly);
  return layers_[0].head_stride[0] * num_heads_ * num_planes_;
}

Status RotateQuantizedRows(CacheConfig& config) {
  auto rotatable = [](const KvFormat& f) {
    return (f.dtype == DType::kInt8 || f.dtype == DType::kFP8E4M3 || f.dtype == DType::kFP8E5M2) &&
           f.scale_axis == ScaleAxis::kPerToken;
  };
  bool any = false;
  if (rotatable(config.format)) {
    config.format.hadamard = true;
    any = true;
  }
  for (KvFormat& f : config.layer_formats) {
    if (rotatable(f)) {
      f.hadamard = true;
      any = true;
    }
  }
  if (!any) {
    return InvalidArgumentError("Hadamard rotation applies to int8 and fp8 KV; the cache stores " +
                                config.format.ToString() + (config.layer_formats.empty() ? "" : " and its layer overrides"));
  }
  return Status::Ok();
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
