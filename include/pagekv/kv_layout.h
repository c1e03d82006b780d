// CacheConfig (what a user asks for) and KvLayout (the byte-exact placement of
// every cached row in the arena, derived from a validated CacheConfig).
//
// The arena is one allocation addressed in four dimensions, K and V in
// separate planes (docs/KV_LAYOUT.md has the full description):
//
//   arena [layer][plane][head][block][slot][row]
//           |      |      |     |      |     `- row_bytes: one K, V or latent
//           |      |      |     |      |        row (head_dim elements, or
//           |      |      |     |      |        kv_lora_rank + rope_dim for MLA)
//           |      |      |     |      `- block_len token slots
//           |      |      |     `- num_blocks; a slab = one block of one
//           |      |      |        (layer, plane, head), block_len rows, its
//           |      |      |        start 64-byte aligned (slab_stride)
//           |      |      `- num_kv_heads (1 for MLA)
//           |      `- 2 planes, K then V (1 plane for MLA: the latent row)
//           `- num_layers
//
//   offset(layer, plane, head, block, slot) =
//       layer * layer_stride + plane * plane_stride + head * head_stride
//     + block * slab_stride + slot * row_bytes
//
// so one block of one (layer, head) is a single contiguous run of
// block_len * row_bytes bytes that a kernel streams linearly.
//
// Thread safety: CacheConfig and KvLayout are immutable values once built.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "pagekv/dtype.h"
#include "pagekv/status.h"

namespace pagekv {

// What the cache stores per token and layer.
enum class CacheKind : uint8_t {
  kPerHead,  // K and V rows per KV head: MHA, GQA and MQA
  kMla,      // one latent row per token (compressed kv + rope key), DeepSeek-style
};

// The attention shape a config describes, derived from the head counts.
enum class AttentionKind : uint8_t { kMha, kGqa, kMqa, kMla };

std::string_view AttentionKindName(AttentionKind kind);  // "MHA", "GQA", "MQA", "MLA"

// Every alignment guarantee of the layout: slab starts are multiples of this.
inline constexpr int64_t kSlabAlignment = 64;

struct CacheConfig {
  CacheKind kind = CacheKind::kPerHead;
  int32_t num_layers = 0;    // > 0
  int32_t num_q_heads = 0;   // > 0; a multiple of num_kv_heads (per-head kinds)
  int32_t num_kv_heads = 0;  // > 0 for kPerHead; unused by the cache for kMla
  int32_t head_dim = 0;      // > 0 for kPerHead: elements per K and V row.
                             // For kMla, the model's per-head dim (used only to
                             // report what a per-head cache would have cost).
  int32_t kv_lora_rank = 0;  // kMla only: compressed kv elements per token, > 0
  int32_t rope_dim = 0;      // kMla only: decoupled rope-key elements per token, >= 0
  int32_t block_len = 128;   // tokens per block; a power of two in [8, 1024]
  KvFormat format = KvFormat::Plain(DType::kF16);
  // Per-layer formats (sensitivity differs by layer, e.g. the first and last
  // layers in f16, the rest int8): empty = `format` for every layer, else
  // exactly num_layers entries. Each layer's rows, slabs and strides follow
  // its own format; see ParseLayerFormats.
  std::vector<KvFormat> layer_formats;

  // The format of one layer. REQUIRES: layer in [0, num_layers).
  const KvFormat& FormatOf(int32_t layer) const {
    return layer_formats.empty() ? format : layer_formats[static_cast<size_t>(layer)];
  }

  // Hybrid caches (sliding-window models): one entry per layer, 0 for a
  // full-attention layer, W > 0 for a layer whose query at position p sees
  // only positions [p - W + 1, p]. Empty = every layer full attention, one
  // block table per sequence. When set, layers of the same window form cache
  // groups of k layers each (k = the gcd of the per-window layer counts);
  // a block holds k layers' slabs and belongs to one group at a time, each
  // group has its own block table per sequence, and a sliding group gives
  // back the blocks its window has passed (KvCache::ReleaseOutOfWindow).
  // Gemma 3 270M: 15 sliding (512) + 3 full layers -> 6 groups of 3 layers.
  // Each window must be at least block_len; layers that share a slot of the
  // block (the i-th layer of every group) must share a format.
  std::vector<int32_t> layer_windows;

  // The window of one layer (0 = full attention).
  int32_t WindowOf(int32_t layer) const {
    return layer_windows.empty() ? 0 : layer_windows[static_cast<size_t>(layer)];
  }

  // Pool size: exactly one of the two must be set (> 0).
  int64_t num_blocks = 0;    // blocks in the pool
  int64_t budget_bytes = 0;  // or: as many blocks as fit in this many bytes

  // Checks every field and combination; the error names the field, its value
  // and the accepted range. Does not check the format is storable by a
  // KvCache (see KvCache::Create).
  Status Validate() const;

  AttentionKind attention_kind() const;
};

// The resolved geometry. Construct with KvLayout::Create.
class KvLayout {
 public:
  // Validates `config` and derives every stride; a budget is turned into
  // num_blocks = floor(budget / bytes_per_block). Errors: any Validate()
  // error, a byte count that overflows 63 bits, a budget smaller than one
  // block.
  static Result<KvLayout> Create(const CacheConfig& config);

  const CacheConfig& config() const { return config_; }

  int32_t num_layers() const { return config_.num_layers; }
  int32_t num_planes() const { return num_planes_; }  // 2 (K, V) or 1 (MLA latent)
  int32_t num_heads() const { return num_heads_; }    // KV heads stored, 1 for MLA
  int32_t block_len() const { return config_.block_len; }
  int64_t num_blocks() const { return num_blocks_; }
  int32_t row_elems() const { return row_elems_; }    // head_dim, or rank + rope_dim
  // True when every layer has the same format (the usual case).
  bool uniform() const { return uniform_; }

  // Per layer: its format, bytes of one row, of one block's slab
  // (block_len rows) and the slab's 64-byte-aligned stride.
  //
  // INT4 KIVI layers (format(layer).IsKivi()) differ: a row as exchanged
  // (KvTokens, WriteLayer, Read, the f16 tail) is head_dim f16 values, so
  // row_bytes(layer) = 2 * head_dim; inside the pool the K slab is
  // block_len / G key groups and the V slab block_len value rows
  // (layout/quantize.h), of different sizes: use the plane overloads, and
  // never RowOffset, on such a layer.
  const KvFormat& format(int32_t layer) const { return config_.FormatOf(layer); }
  bool kivi(int32_t layer) const { return layers_[static_cast<size_t>(layer)].kivi; }
  int64_t row_bytes(int32_t layer) const { return layers_[static_cast<size_t>(layer)].row_bytes; }
  int64_t slab_bytes(int32_t layer, int32_t plane) const {
    return layers_[static_cast<size_t>(layer)].slab_bytes[plane];
  }
  int64_t slab_stride(int32_t layer, int32_t plane) const {
    return layers_[static_cast<size_t>(layer)].slab_stride[plane];
  }
  int64_t head_stride(int32_t layer, int32_t plane) const {
    return layers_[static_cast<size_t>(layer)].head_stride[plane];
  }
  int64_t layer_offset(int32_t layer) const { return layers_[static_cast<size_t>(layer)].offset; }

  // INT4 KIVI: the tokens per key group (0 on other layers), and the bytes of
  // the f16 tail a sequence keeps beside the pool for its not-yet-full group
  // (every KIVI layer, K and V, every head; 0 without KIVI layers).
  int32_t kivi_group(int32_t layer) const { return layers_[static_cast<size_t>(layer)].kivi ? config_.FormatOf(layer).group_size : 0; }
  int64_t tail_bytes_per_sequence() const { return tail_bytes_per_sequence_; }
  // Offset of one (layer, plane, head)'s G f16 rows within a sequence's tail.
  int64_t TailOffset(int32_t layer, int32_t plane, int32_t head) const {
    return layers_[static_cast<size_t>(layer)].tail_offset +
           (int64_t{plane} * num_heads_ + head) * int64_t{config_.FormatOf(layer).group_size} * row_bytes(layer);
  }

  // The same for a uniform layout (every layer alike). REQUIRES: uniform();
  // a per-layer layout aborts here, so code that forgot a layer fails loudly.
  int64_t row_bytes() const;
  int64_t slab_bytes() const;
  int64_t slab_stride() const;
  int64_t head_stride() const;
  int64_t plane_stride() const;
  int64_t layer_stride() const;
  // (Uniform means every layer has the same format and no layer is KIVI.)

  int64_t total_bytes() const { return total_bytes_; }  // the whole arena

  // Bytes one block occupies across its layers, planes and heads (with
  // padding). A block holds layers_per_block() layers: every layer of a
  // uniform cache, one group's of a hybrid one.
  int64_t bytes_per_block() const { return bytes_per_block_; }
  // Bytes one token's rows occupy across all layers, planes and heads (no
  // padding; a KIVI layer's key-group parameters are shared out over the
  // group's tokens, rounded up to whole bytes): what a token costs in a
  // cache that keeps every layer's every token.
  int64_t bytes_per_token() const { return bytes_per_token_; }
  // Bytes one token's rows occupy in one block (its group's layers only):
  // bytes_per_token() / num_groups().
  int64_t bytes_per_block_token() const { return bytes_per_block_token_; }
  // Number of slabs a block id names: layers_per_block * num_planes * num_heads.
  int64_t slabs_per_block() const { return slabs_per_block_; }

  // --- cache groups (CacheConfig::layer_windows) ----------------------------
  // One group (every layer, window 0) for a uniform cache.
  int32_t num_groups() const { return static_cast<int32_t>(groups_.size()); }
  int32_t layers_per_block() const { return layers_per_block_; }
  // The group a layer's rows live in, and its slot among the group's layers.
  int32_t group_of(int32_t layer) const { return layers_[static_cast<size_t>(layer)].group; }
  // A group's window (0: full attention) and its layers, ascending.
  int32_t group_window(int32_t group) const { return groups_[static_cast<size_t>(group)].window; }
  std::span<const int32_t> group_layers(int32_t group) const { return groups_[static_cast<size_t>(group)].layers; }
  // The layers whose slabs make up one block, in payload order: group 0's
  // (every group's i-th layer shares the i-th layer's offsets and format).
  std::span<const int32_t> block_layers() const { return group_layers(0); }
  // True when the cache has more than one group or any window.
  bool hybrid() const { return groups_.size() > 1 || groups_[0].window > 0; }
  // Blocks one sequence of `tokens` tokens holds across its groups while a
  // step of up to `step_tokens` new tokens runs: ceil(tokens / block_len)
  // per full group; per sliding group of window W at most that and at most
  // ceil((W - 1 + step_tokens) / block_len) + 1 (the window of the step's
  // first query to its last token, straddling block edges).
  int64_t BlocksHeld(int64_t tokens, int64_t step_tokens) const;

  // Slab alignment padding inside one block, all slabs together.
  int64_t padding_bytes_per_block() const { return padding_bytes_per_block_; }

  // Byte offset of the first row of a slab. REQUIRES: all indices in range.
  int64_t SlabOffset(int32_t layer, int32_t plane, int32_t head, int64_t block) const {
    const Layer& L = layers_[static_cast<size_t>(layer)];
    return L.offset + L.plane_offset[plane] + head * L.head_stride[plane] + block * L.slab_stride[plane];
  }
  // Byte offset of one row. REQUIRES: all indices in range; not a KIVI layer.
  int64_t RowOffset(int32_t layer, int32_t plane, int32_t head, int64_t block,
                    int32_t slot) const {
    return SlabOffset(layer, plane, head, block) + slot * layers_[static_cast<size_t>(layer)].row_bytes;
  }

 private:
  KvLayout() = default;

  struct Layer {
    int32_t group = 0;
    bool kivi = false;
    int64_t row_bytes = 0;
    int64_t slab_bytes[2] = {0, 0}, slab_stride[2] = {0, 0}, head_stride[2] = {0, 0}, plane_offset[2] = {0, 0};
    int64_t offset = 0;
    int64_t tail_offset = 0;
  };

  CacheConfig config_;
  int32_t num_planes_ = 0;
  int32_t num_heads_ = 0;
  int32_t row_elems_ = 0;
  int64_t num_blocks_ = 0;
  bool uniform_ = true;
  std::vector<Layer> layers_;
  int64_t total_bytes_ = 0;
  int64_t bytes_per_block_ = 0;
  int64_t bytes_per_token_ = 0;
  int64_t slabs_per_block_ = 0;
  int64_t bytes_per_block_token_ = 0;
  int32_t layers_per_block_ = 0;
  struct Group {
    int32_t window = 0;
    std::vector<int32_t> layers;
  };
  std::vector<Group> groups_;
  int64_t padding_bytes_per_block_ = 0;
  int64_t tail_bytes_per_sequence_ = 0;
};

// Bytes that `elems` elements of `format` occupy, including scale overhead
// for per-token groups. Per-channel scales (shared by a group of tokens) are
// accounted per block; see KvLayout. Returns nullopt-like -1 on overflow.
int64_t FormatRowBytes(const KvFormat& format, int64_t elems);

// Per-layer formats from a spec of comma-separated LAYERS=DTYPE overrides on
// top of `base` for every other layer; LAYERS is an index (negative counts
// from the end: -1 is the last layer) or an inclusive range a:b. Example,
// the first and last layers in f16 and the rest in the base int8:
//   "0=f16,-1=f16"
// Each dtype is stored the way KvFormat::ForDType says for rows of
// row_elems elements. An empty spec gives an empty list (every layer uses
// the base). Errors name the bad entry: a missing '=', a layer outside the
// model, an unknown dtype, a layer given twice.
Result<std::vector<KvFormat>> ParseLayerFormats(std::string_view spec, int32_t num_layers, int32_t row_elems,
                                                const KvFormat& base);

// Marks every int8 and fp8 format of the config (the base and the layer
// overrides) Hadamard-rotated (KvFormat::hadamard). Error: none of them is
// int8 or fp8. KvLayout::Create then checks the row length is a power of two.
Status RotateQuantizedRows(CacheConfig& config);

}  // namespace pagekv
