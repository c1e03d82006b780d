// ReplayTrace (include/pagekv/replay.h): a trace through a real KvCache and
// PrefixCache. The cache's geometry is the smallest the layout allows (one
// layer, one head, head_dim 8): replay moves no KV bytes, it exercises the
// bookkeeping, and untouched arena pages cost no memory.
#include "pagekv/replay.h"

#include <chrono>
#include <vector>

#include "bench/trace.h"
#include "pagekv/kv_cache.h"

namespace pagekv {

Result<TraceFormat> ParseTraceFormat(const std::string& name) {
  if (name == "mooncake") return TraceFormat::kMooncake;
  if (name == "azure") return TraceFormat::kAzure;
  if (name == "auto") return TraceFormat::kAuto;
  return InvalidArgumentError("trace format '" + name + "': use mooncake, azure or auto");
}

Result<ReplayReport> ReplayTrace(const ReplayOptions& o) {
  if (o.capacity_blocks < 0) return InvalidArgumentError("--capacity-blocks must be positive (omit it for unlimited)");
  TraceFormat format = o.format;
  PAGEKV_ASSIGN_OR_RETURN(std::vector<bench::TraceRequest> requests, bench::ReadTrace(o.trace_path, o.format, 0, &format));
  ReplayReport report;
  report.format = format == TraceFormat::kAzure ? "azure" : "mooncake";
  const int64_t bl = o.block_len;
  int64_t capacity = o.capacity_blocks;
  if (capacity == 0) {
    for (const bench::TraceRequest& r : requests) capacity += (r.input_length + bl - 1) / std::max<int64_t>(bl, 1);
    capacity = std::max<int64_t>(capacity, 1);
  }
  report.capacity_blocks = capacity;
  KvCacheOptions co;
  if (o.sliding_window > 0) {
    if (o.sliding_pattern < 1) return InvalidArgumentError("--sliding-pattern must be at least 1");
    co.config.layer_windows.assign(6, o.sliding_window);
    for (int32_t l = o.sliding_pattern - 1; o.sliding_pattern > 1 && l < 6; l += o.sliding_pattern) {
      co.config.layer_windows[static_cast<size_t>(l)] = 0;
    }
  }
  co.config.num_layers = o.sliding_window > 0 ? 6 : 1;
  co.config.num_q_heads = 1;
  co.config.num_kv_heads = 1;
  co.config.head_dim = 8;
  co.config.block_len = o.block_len;
  co.config.format = KvFormat::Plain(DType::kF16);
  co.config.num_blocks = capacity;
  co.prefault = false;
  if (o.sliding_window > 0) {
    // The same bytes: blocks of one group's layers, 6 / layers_per_block
    // of them for each block of all 6 layers.
    PAGEKV_ASSIGN_OR_RETURN(const KvLayout probe, KvLayout::Create(co.config));
    co.config.num_blocks = capacity * (6 / probe.layers_per_block());
  }
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(co));
  report.kv_groups = cache->layout().num_groups();
  PrefixCacheOptions po;
  po.hasher.kind = o.hash;
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<PrefixCache> pc, PrefixCache::Create(*cache, po));

  std::vector<int32_t> tokens;
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < requests.size(); ++i) {
    const bench::TraceRequest& r = requests[i];
    ++report.requests;
    bench::TraceTokens(r, static_cast<int64_t>(i), 32000, tokens);
    const int64_t full_tokens = r.input_length / bl * bl;
    PAGEKV_ASSIGN_OR_RETURN(PrefixMatch match, pc->Lookup(tokens, {}, full_tokens));
    if (!pc->CanAdmit(match, r.input_length - match.num_tokens)) {
      ++report.rejected;
      continue;
    }
    PAGEKV_ASSIGN_OR_RETURN(PrefixCache::Admitted a, pc->AddSequence(tokens, {}, {}, full_tokens));
    PAGEKV_ASSIGN_OR_RETURN(bool fit, cache->Reserve(a.seq, r.input_length - a.match.num_tokens));
    if (!fit) return InternalError("replay: an admitted request did not fit");
    PAGEKV_RETURN_IF_ERROR(pc->Publish(a.seq, tokens));
    PAGEKV_RETURN_IF_ERROR(cache->ReleaseOutOfWindow(a.seq).status());  // published first: they stay cached
    PAGEKV_RETURN_IF_ERROR(pc->Free(a.seq));
    report.total_blocks += r.input_length / bl;
    report.hit_blocks += static_cast<int64_t>(a.match.blocks.size());
    report.total_tokens += r.input_length;
    report.hit_tokens += a.match.num_tokens;
    report.peak_blocks_cached = std::max(report.peak_blocks_cached, pc->Stats().cached_blocks);
  }
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report.lookups_per_second = report.seconds > 0 ? static_cast<double>(report.requests) / report.seconds : 0;
  report.evicted_blocks = pc->Stats().evicted;
  auto rate = [](int64_t a, int64_t b) { return b > 0 ? static_cast<double>(a) / static_cast<double>(b) : 0.0; };
  report.block_hit_rate = rate(report.hit_blocks, report.total_blocks);
  report.token_hit_rate = rate(report.hit_tokens, report.total_tokens);
  return report;
}

}  // namespace pagekv
