#include <algorithm>
#include <climits>
#include <string>

#include <fmt/format.h>

#include "base/checked_math.h"
#include "pagekv/plan.h"
#include "pagekv/units.h"

namespace pagekv {
namespace {

// Advice for a plan that does not fit, each line with the numbers that would.
void AddAdvice(const PlanRequest& req, Plan& plan) {
  const CacheConfig& c = plan.config;
  if (plan.budget_bytes > 0 && !plan.fits_budget) {
    const int64_t max_blocks = plan.budget_bytes / plan.bytes_per_block;
    plan.advice.push_back(fmt::format(
        "fewer blocks: {} blocks x {} = {} exceed the budget of {}; at most {} blocks fit",
        plan.num_blocks, FormatBytes(plan.bytes_per_block), FormatBytes(plan.total_bytes),
        FormatBytes(plan.budget_bytes), max_blocks));
  }
  if (plan.fits_budget && plan.fits_batch) return;

  if (plan.seq_len > 0 && plan.batch > 0 && !plan.fits_batch) {
    plan.advice.push_back(fmt::format(
        "fewer sequences: {} blocks hold {} sequences of {} tokens, not {}", plan.num_blocks,
        plan.max_sequences, plan.seq_len, plan.batch));
    const int64_t per_seq_blocks = plan.num_blocks / plan.batch;
    plan.advice.push_back(fmt::format(
        "shorter sequences: {} sequences fit at up to {} tokens each", plan.batch,
        per_seq_blocks * c.block_len));
    const int64_t need = CeilDiv(plan.seq_len, c.block_len) * plan.batch * plan.bytes_per_block;
    plan.advice.push_back(fmt::format("a larger budget: {} sequences of {} tokens need {}",
                                      plan.batch, plan.seq_len, FormatBytes(need)));
  }
  if (c.format.dtype == DType::kF32) {
    plan.advice.push_back(fmt::format(
        "a smaller dtype: f16 or bf16 halve every byte count ({} per token instead of {})",
        FormatBytes(plan.bytes_per_token / 2), FormatBytes(plan.bytes_per_token)));
  }
  if (plan.seq_len > 0 && plan.slack_tokens_per_sequence > 0 && c.block_len > 16) {
    plan.advice.push_back(fmt::format(
        "a shorter block_len: each sequence wastes {} slots of its last block at block_len {}; "
        "block_len 16 wastes at most 15 (smaller blocks cost more block-table entries)",
        plan.slack_tokens_per_sequence, c.block_len));
  }
  (void)req;
}

}  // namespace

Result<Plan> MakePlan(const PlanRequest& req) {
  if (req.seq_len < 0) return InvalidArgumentError("seq_len = " + std::to_string(req.seq_len) + ": must be >= 0");
  if (req.batch < 0) return InvalidArgumentError("batch = " + std::to_string(req.batch) + ": must be >= 0");

  CacheConfig config = req.config;
  const int64_t budget = config.budget_bytes;
  if (config.num_blocks > 0) {
    config.budget_bytes = 0;  // blocks given: the budget is only checked
  } else if (budget <= 0) {
    if (req.seq_len <= 0 || req.batch <= 0) {
      return InvalidArgumentError(
          "pool size missing: give a block count (--max-blocks), a byte budget (--budget), or "
          "--seq-len with --batch to size the pool for that work");
    }
    if (config.block_len <= 0) return config.Validate();
    CacheConfig one = config;
    one.num_blocks = 1;
    PAGEKV_ASSIGN_OR_RETURN(const KvLayout sizing, KvLayout::Create(one));
    auto blocks = CheckedMul(sizing.BlocksHeld(req.seq_len, 1), req.batch);
    if (!blocks) return InvalidArgumentError("seq_len x batch overflows");
    config.num_blocks = *blocks;
  }
  PAGEKV_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::Create(config));

  Plan plan;
  plan.config = layout.config();
  plan.config.num_blocks = layout.num_blocks();
  plan.config.budget_bytes = 0;
  plan.attention = config.attention_kind();
  plan.row_bytes = layout.row_bytes(0);  // layer 0's when the layers differ
  plan.slab_bytes = layout.slab_bytes(0, 0);
  plan.slab_stride = layout.slab_stride(0, 0);
  plan.bytes_per_token = layout.bytes_per_token();
  plan.bytes_per_token_per_layer = layout.bytes_per_token() / layout.num_layers();
  plan.bytes_per_block = layout.bytes_per_block();
  plan.padding_bytes_per_block = layout.padding_bytes_per_block();
  plan.num_blocks = layout.num_blocks();
  plan.total_bytes = layout.total_bytes();
  plan.tokens_capacity = layout.num_blocks() * layout.block_len();
  plan.tail_bytes_per_sequence = layout.tail_bytes_per_sequence();

  plan.budget_bytes = budget > 0 ? budget : 0;
  plan.fits_budget = plan.budget_bytes == 0 || plan.total_bytes <= plan.budget_bytes;

  plan.seq_len = req.seq_len;
  plan.batch = req.batch;
  if (req.seq_len > 0) {
    plan.blocks_per_sequence = layout.BlocksHeld(req.seq_len, 1);  // a hybrid cache's sliding groups: their window
    auto bytes = CheckedMul(plan.blocks_per_sequence, plan.bytes_per_block);
    if (!bytes) return InvalidArgumentError("seq_len " + std::to_string(req.seq_len) + " overflows");
    plan.bytes_per_sequence = *bytes;
    plan.slack_tokens_per_sequence = plan.blocks_per_sequence * layout.block_len() - req.seq_len;
    plan.max_sequences = plan.num_blocks / plan.blocks_per_sequence;
    plan.fits_batch = req.batch == 0 || plan.max_sequences >= req.batch;
  }

  if (config.kind == CacheKind::kMla && config.head_dim > 0) {
    const int64_t elems =
        int64_t{config.num_q_heads} * ((config.head_dim + config.rope_dim) + config.head_dim);
    const int64_t per_layer = FormatRowBytes(config.format, elems);
    auto per_token = CheckedMul(per_layer, config.num_layers);
    if (per_layer > 0 && per_token) {
      plan.per_head_bytes_per_token = *per_token;
      plan.mla_reduction =
          static_cast<double>(plan.per_head_bytes_per_token) / static_cast<double>(plan.bytes_per_token);
    }
  }
  if (layout.hybrid()) {
    CacheConfig flat = config;
    flat.layer_windows.clear();
    flat.num_blocks = 1;
    flat.budget_bytes = 0;
    PAGEKV_ASSIGN_OR_RETURN(const KvLayout uniform, KvLayout::Create(flat));
    plan.layers_per_block = layout.layers_per_block();
    for (int32_t g = 0; g < layout.num_groups(); ++g) {
      const auto layers = layout.group_layers(g);
      plan.groups.push_back({layout.group_window(g), {layers.begin(), layers.end()}, layout.bytes_per_block_token()});
    }
    std::vector<int64_t> points = {8192, 32768, 131072};
    if (req.seq_len > 0 && std::find(points.begin(), points.end(), req.seq_len) == points.end()) points.push_back(req.seq_len);
    for (int64_t t : points) {
      auto u = CheckedMul(CeilDiv(t, layout.block_len()), uniform.bytes_per_block());
      auto h = CheckedMul(layout.BlocksHeld(t, 1), layout.bytes_per_block());
      if (!u || !h) return InvalidArgumentError("tokens " + std::to_string(t) + " overflow the byte counts");
      plan.savings.push_back({t, *u, *h});
    }
  }
  AddAdvice(req, plan);
  return plan;
}

}  // namespace pagekv

namespace pagekv {
namespace {

// Values outside int32 become ones CacheConfig's checks reject with the
// field's name.
int32_t Narrow(int64_t v) { return v > INT32_MAX ? INT32_MAX : (v < INT32_MIN ? INT32_MIN : static_cast<int32_t>(v)); }

}  // namespace

Result<ResolvedPlanRequest> ResolvePlanRequest(const GeometrySpec& a, const GeometryNames& names) {
  ResolvedPlanRequest out;
  PlanRequest& req = out.request;
  CacheConfig& c = req.config;
  if (a.preset) {
    PAGEKV_ASSIGN_OR_RETURN(ModelPreset p, FindPreset(*a.preset));
    c = p.config;
    out.context_len = p.context_len;
    out.title = fmt::format("{}: {}", p.name, p.description);
  } else {
    if (!a.num_layers) {
      return InvalidArgumentError(fmt::format(
          "no model geometry: give {} NAME, or {} with {} and {} (or {} for an MLA cache)", names.preset,
          names.num_layers, names.num_kv_heads, names.head_dim, names.kv_lora_rank));
    }
    out.title = "custom geometry";
  }
  if (a.num_layers) c.num_layers = Narrow(*a.num_layers);
  if (a.kv_lora_rank) {
    c.kind = CacheKind::kMla;
    c.kv_lora_rank = Narrow(*a.kv_lora_rank);
    c.num_kv_heads = 0;
  }
  if (a.rope_dim) c.rope_dim = Narrow(*a.rope_dim);
  if (a.num_kv_heads) c.num_kv_heads = Narrow(*a.num_kv_heads);
  if (a.head_dim) c.head_dim = Narrow(*a.head_dim);
  if (a.num_q_heads) {
    c.num_q_heads = Narrow(*a.num_q_heads);
  } else if (!a.preset) {
    c.num_q_heads = c.kind == CacheKind::kMla ? 1 : c.num_kv_heads;  // MHA unless told
  }
  if (a.block_len) c.block_len = Narrow(*a.block_len);
  if (a.dtype) {
    PAGEKV_ASSIGN_OR_RETURN(DType d, ParseDType(*a.dtype));
    // int8 / fp8: one f16 scale per row (the row is set below, once the
    // shape is known); int4: KIVI groups of 32 tokens.
    c.format = KvFormat::ForDType(d, 0);
  }
  auto positive = [](const char* name, int64_t v) -> Status {
    if (v <= 0) return InvalidArgumentError(fmt::format("{} {}: must be positive", name, v));
    return Status::Ok();
  };
  if (a.num_blocks) {
    PAGEKV_RETURN_IF_ERROR(positive(names.num_blocks, *a.num_blocks));
    c.num_blocks = *a.num_blocks;
  }
  if (a.budget_bytes) {
    PAGEKV_RETURN_IF_ERROR(positive(names.budget, *a.budget_bytes));
    c.budget_bytes = *a.budget_bytes;
    if (!a.num_blocks) c.num_blocks = 0;  // the budget decides, not the preset
  }
  if (a.seq_len) {
    PAGEKV_RETURN_IF_ERROR(positive(names.seq_len, *a.seq_len));
    req.seq_len = *a.seq_len;
  }
  if (a.batch) {
    PAGEKV_RETURN_IF_ERROR(positive(names.batch, *a.batch));
    req.batch = *a.batch;
    if (req.seq_len == 0) req.seq_len = out.context_len;  // a batch of full-context sequences
  }
  if (a.sliding_window || a.sliding_pattern) {
    const int64_t w = a.sliding_window.value_or(0);
    const int64_t period = a.sliding_pattern.value_or(6);
    if (!a.sliding_window || w <= 0) {
      return InvalidArgumentError("a sliding pattern needs --sliding-window W (tokens, > 0)");
    }
    if (period < 1 || c.num_layers < 1) {
      return InvalidArgumentError(fmt::format("sliding pattern {}: must be at least 1 (1: every layer slides)", period));
    }
    c.layer_windows.assign(static_cast<size_t>(c.num_layers), Narrow(w));
    if (period > 1) {
      for (int32_t l = Narrow(period) - 1; l < c.num_layers; l += Narrow(period)) c.layer_windows[static_cast<size_t>(l)] = 0;
    }
  } else if (!c.layer_windows.empty() && static_cast<int64_t>(c.layer_windows.size()) != c.num_layers) {
    return InvalidArgumentError(fmt::format("the preset's {} sliding-window layers do not match {} layers: give "
                                            "--sliding-window and --sliding-pattern for the new layer count",
                                            c.layer_windows.size(), c.num_layers));
  }
  if (a.uniform) c.layer_windows.clear();
  const int32_t row_elems = c.kind == CacheKind::kMla ? c.kv_lora_rank + c.rope_dim : c.head_dim;
  if (!c.format.IsPlainFloat()) c.format = KvFormat::ForDType(c.format.dtype, row_elems);
  if (a.layer_dtypes) {
    PAGEKV_ASSIGN_OR_RETURN(c.layer_formats, ParseLayerFormats(*a.layer_dtypes, c.num_layers, row_elems, c.format));
  }
  if (c.num_blocks == 0 && c.budget_bytes == 0 && req.batch == 0 && out.context_len > 0) {
    // No pool size at all: one sequence of the preset's whole context.
    if (req.seq_len == 0) req.seq_len = out.context_len;
    req.batch = 1;
    out.one_full_context = true;
  }
  return out;
}

namespace {

std::string SizesThatWork(int32_t num_q_heads, int32_t num_kv_heads) {
  std::string out;
  for (int32_t t = 1; t <= num_q_heads; ++t) {
    if (num_q_heads % t == 0 && (num_kv_heads % t == 0 || t % num_kv_heads == 0)) {
      out += (out.empty() ? "" : ", ") + std::to_string(t);
    }
  }
  return out;
}

}  // namespace

Result<HeadShard> ShardHeads(int32_t num_q_heads, int32_t num_kv_heads, int rank, int size) {
  if (num_q_heads < 1 || num_kv_heads < 1 || num_q_heads % num_kv_heads != 0) {
    return InvalidArgumentError("tensor parallel: " + std::to_string(num_q_heads) + " query heads over " +
                                std::to_string(num_kv_heads) + " KV heads is not a GQA layer");
  }
  if (size < 1 || rank < 0 || rank >= size) {
    return InvalidArgumentError("tensor parallel: rank " + std::to_string(rank) + " of " + std::to_string(size));
  }
  if (num_q_heads % size != 0 || (num_kv_heads % size != 0 && size % num_kv_heads != 0)) {
    return InvalidArgumentError("tensor parallel size " + std::to_string(size) + " does not split " +
                                std::to_string(num_q_heads) + " query heads over " + std::to_string(num_kv_heads) +
                                " KV heads (it must divide the query heads, and divide or be a multiple of the KV heads): "
                                "use one of " + SizesThatWork(num_q_heads, num_kv_heads));
  }
  HeadShard s;
  s.q_heads = num_q_heads / size;
  s.q_head0 = rank * s.q_heads;
  if (num_kv_heads % size == 0) {
    s.kv_heads = num_kv_heads / size;
    s.kv_head0 = rank * s.kv_heads;
  } else {
    s.kv_replicas = size / num_kv_heads;
    s.kv_heads = 1;
    s.kv_head0 = rank / s.kv_replicas;
  }
  return s;
}

Result<std::pair<int64_t, int64_t>> ShardRange(int64_t total, int64_t align, int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size || align < 1) {
    return InvalidArgumentError("tensor parallel: rank " + std::to_string(rank) + " of " + std::to_string(size));
  }
  if (total % align != 0 || total / align < size) {
    return InvalidArgumentError("tensor parallel size " + std::to_string(size) + " cannot split " + std::to_string(total) +
                                " rows in whole blocks of " + std::to_string(align) + ": use at most " +
                                std::to_string(std::max<int64_t>(1, total / align)) + " ranks");
  }
  const int64_t units = total / align;
  return std::pair<int64_t, int64_t>{units * rank / size * align, units * (rank + 1) / size * align};
}

}  // namespace pagekv
