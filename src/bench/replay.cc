// ReplayTrace (include/pagekv/replay.h): a trace through a real KvCache and
// PrefixCache. The cache's geometry is the smallest the layout allows (one
// layer, one head, head_dim 8): replay moves no KV bytes, it exercises the
// bookkeeping, and untouched arena pages cost no memory.
#include "pagekv/replay.h"

#include <chrono>
#include <fstream>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "pagekv/kv_cache.h"

namespace pagekv {
namespace {

constexpr int64_t kTraceBlock = 512;  // Mooncake hash ids name 512-token chunks

struct Request {
  int64_t input_length = 0;
  std::vector<int64_t> hash_ids;  // Mooncake; empty for Azure
};

uint64_t Mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Token ids of a request: chunk i from hash_ids[i] (Mooncake), or unique to
// the request (Azure, seeded by its index).
void MakeTokens(const Request& r, int64_t index, std::vector<int32_t>& out) {
  out.resize(static_cast<size_t>(r.input_length));
  for (int64_t j = 0; j < r.input_length; ++j) {
    const uint64_t chunk = r.hash_ids.empty() ? (uint64_t{1} << 62) + static_cast<uint64_t>(index)
                                              : static_cast<uint64_t>(r.hash_ids[static_cast<size_t>(j / kTraceBlock)]);
    out[static_cast<size_t>(j)] = static_cast<int32_t>(Mix(chunk * kTraceBlock + static_cast<uint64_t>(j % kTraceBlock)) % 32000);
  }
}

Status LineError(int64_t line, const std::string& what) {
  return InvalidArgumentError("trace line " + std::to_string(line) + ": " + what);
}

Result<std::vector<Request>> ReadMooncake(std::istream& in) {
  std::vector<Request> out;
  std::string text;
  for (int64_t line = 1; std::getline(in, text); ++line) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) return LineError(line, "not a JSON object (expected Mooncake JSON lines)");
    if (!j.contains("input_length") || !j["input_length"].is_number_integer()) {
      return LineError(line, "field 'input_length' is missing or not an integer");
    }
    Request r;
    r.input_length = j["input_length"].get<int64_t>();
    if (r.input_length < 0) return LineError(line, "field 'input_length' is negative");
    if (!j.contains("hash_ids") || !j["hash_ids"].is_array()) {
      return LineError(line, "field 'hash_ids' is missing or not an array");
    }
    for (const auto& h : j["hash_ids"]) {
      if (!h.is_number_integer() || h.get<int64_t>() < 0) {
        return LineError(line, "field 'hash_ids' holds something other than a non-negative integer");
      }
      r.hash_ids.push_back(h.get<int64_t>());
    }
    const int64_t want = (r.input_length + kTraceBlock - 1) / kTraceBlock;
    if (static_cast<int64_t>(r.hash_ids.size()) != want) {
      return LineError(line, "field 'hash_ids' has " + std::to_string(r.hash_ids.size()) + " ids but input_length " +
                                 std::to_string(r.input_length) + " needs " + std::to_string(want) + " (one per 512 tokens)");
    }
    out.push_back(std::move(r));
  }
  return out;
}

Result<std::vector<Request>> ReadAzure(std::istream& in) {
  std::vector<Request> out;
  std::string text;
  int64_t column = -1;
  for (int64_t line = 1; std::getline(in, text); ++line) {
    if (!text.empty() && text.back() == '\r') text.pop_back();
    if (text.empty()) continue;
    std::vector<std::string> cells;
    std::stringstream ss(text);
    for (std::string cell; std::getline(ss, cell, ',');) cells.push_back(cell);
    if (column < 0) {
      for (size_t i = 0; i < cells.size(); ++i) {
        if (cells[i].find("ContextTokens") != std::string::npos) column = static_cast<int64_t>(i);
      }
      if (column < 0) return LineError(line, "no 'ContextTokens' column in the header (expected an Azure CSV)");
      continue;
    }
    if (static_cast<int64_t>(cells.size()) <= column) return LineError(line, "field 'ContextTokens' is missing");
    Request r;
    char* end = nullptr;
    r.input_length = std::strtoll(cells[static_cast<size_t>(column)].c_str(), &end, 10);
    if (end == cells[static_cast<size_t>(column)].c_str() || *end != '\0') {
      return LineError(line, "field 'ContextTokens' is not an integer");
    }
    if (r.input_length < 0) return LineError(line, "field 'ContextTokens' is negative");
    out.push_back(r);
  }
  if (column < 0) return InvalidArgumentError("trace is empty: no header line");
  return out;
}

}  // namespace

Result<ReplayReport> ReplayTrace(const ReplayOptions& o) {
  std::ifstream in(o.trace_path);
  if (!in) return NotFoundError("cannot open trace '" + o.trace_path + "'");
  TraceFormat format = o.format;
  if (format == TraceFormat::kAuto) {
    const std::string& p = o.trace_path;
    format = p.size() >= 4 && p.compare(p.size() - 4, 4, ".csv") == 0 ? TraceFormat::kAzure : TraceFormat::kMooncake;
  }
  if (o.capacity_blocks < 0) return InvalidArgumentError("--capacity-blocks must be positive (omit it for unlimited)");
  PAGEKV_ASSIGN_OR_RETURN(std::vector<Request> requests,
                          format == TraceFormat::kAzure ? ReadAzure(in) : ReadMooncake(in));
  ReplayReport report;
  report.format = format == TraceFormat::kAzure ? "azure" : "mooncake";
  const int64_t bl = o.block_len;
  int64_t capacity = o.capacity_blocks;
  if (capacity == 0) {
    for (const Request& r : requests) capacity += (r.input_length + bl - 1) / std::max<int64_t>(bl, 1);
    capacity = std::max<int64_t>(capacity, 1);
  }
  report.capacity_blocks = capacity;
  KvCacheOptions co;
  co.config.num_layers = 1;
  co.config.num_q_heads = 1;
  co.config.num_kv_heads = 1;
  co.config.head_dim = 8;
  co.config.block_len = o.block_len;
  co.config.format = KvFormat::Plain(DType::kF16);
  co.config.num_blocks = capacity;
  co.prefault = false;
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(co));
  PrefixCacheOptions po;
  po.hasher.kind = o.hash;
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<PrefixCache> pc, PrefixCache::Create(*cache, po));

  std::vector<int32_t> tokens;
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    ++report.requests;
    MakeTokens(r, static_cast<int64_t>(i), tokens);
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
