#include "base/json_nesting.h"
#include "bench/trace.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "base/regular_file.h"

namespace pagekv::bench {

namespace {

uint64_t Mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

void TraceTokens(const TraceRequest& r, int64_t index, int32_t vocab, std::vector<int32_t>& out, int64_t chunk_tokens) {
  // chunk_tokens < 512 scales the prompt down: each 512-token chunk becomes
  // chunk_tokens tokens, the same function of its hash id.
  const int64_t n = (r.input_length * chunk_tokens + kTraceBlock - 1) / kTraceBlock;
  out.resize(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t chunk = r.hash_ids.empty() ? (uint64_t{1} << 62) + static_cast<uint64_t>(index)
                                              : static_cast<uint64_t>(r.hash_ids[static_cast<size_t>(j / chunk_tokens)]);
    out[static_cast<size_t>(j)] = 3 + static_cast<int32_t>(Mix(chunk * kTraceBlock + static_cast<uint64_t>(j % chunk_tokens)) %
                                                           static_cast<uint64_t>(vocab - 3));
  }
}

namespace {

Status LineError(int64_t line, const std::string& what) {
  return InvalidArgumentError("trace line " + std::to_string(line) + ": " + what);
}

// A token count of a trace line: an integer in [0, kMaxTraceTokens]; the
// error names the field. (Far above any model's context, so a real trace
// never meets it, and small enough that a request's tokens always fit in
// memory.)
constexpr int64_t kMaxTraceTokens = int64_t{1} << 24;

std::optional<std::string> BadCount(const std::string& field, int64_t v) {
  if (v < 0) return "field '" + field + "' is negative";
  if (v > kMaxTraceTokens) {
    return "field '" + field + "' is " + std::to_string(v) + ", above the limit of " + std::to_string(kMaxTraceTokens) +
           " tokens";
  }
  return std::nullopt;
}

// A JSON token count: an integer (not one beyond int64) within the limit.
std::optional<std::string> BadJsonCount(const std::string& field, const nlohmann::json& v) {
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(kMaxTraceTokens)) {
    return "field '" + field + "' is " + v.dump() + ", above the limit of " + std::to_string(kMaxTraceTokens) + " tokens";
  }
  if (!v.is_number_integer()) return "field '" + field + "' is not an integer";
  return BadCount(field, v.get<int64_t>());
}

// One line of at most kMaxLineBytes (far beyond a real trace's: a Mooncake
// line at the token limit has 32768 hash ids); false at the end. A longer
// one sets too_long and is skipped to its end, never held whole.
constexpr size_t kMaxLineBytes = size_t{4} << 20;
bool ReadLine(std::istream& in, std::string& out, bool& too_long) {
  out.clear();
  too_long = false;
  std::streambuf* sb = in.rdbuf();
  bool any = false;
  for (int c; (c = sb->sbumpc()) != std::char_traits<char>::eof();) {
    any = true;
    if (c == '\n') return true;
    if (out.size() >= kMaxLineBytes) {
      too_long = true;
      continue;
    }
    out.push_back(static_cast<char>(c));
  }
  return any;
}

// A decimal integer cell, wholly consumed and within int64.
std::optional<int64_t> ParseInt(const std::string& cell) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(cell.c_str(), &end, 10);
  if (end == cell.c_str() || *end != '\0' || errno == ERANGE) return std::nullopt;
  return v;
}

Result<std::vector<TraceRequest>> ReadMooncake(std::istream& in, int64_t limit) {
  std::vector<TraceRequest> out;
  std::string text;
  bool too_long = false;
  for (int64_t line = 1; (limit <= 0 || static_cast<int64_t>(out.size()) < limit) && ReadLine(in, text, too_long); ++line) {
    if (too_long) return LineError(line, "longer than 4 MiB (not a trace line)");
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (JsonNesting(text) > kMaxJsonNesting) return LineError(line, "nests more than 128 levels deep (not a trace line)");
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) return LineError(line, "not a JSON object (expected Mooncake JSON lines)");
    if (!j.contains("input_length") || !j["input_length"].is_number_integer()) {
      return LineError(line, "field 'input_length' is missing or not an integer");
    }
    if (auto bad = BadJsonCount("input_length", j["input_length"])) return LineError(line, *bad);
    TraceRequest r;
    r.input_length = j["input_length"].get<int64_t>();
    if (j.contains("output_length")) {
      if (auto bad = BadJsonCount("output_length", j["output_length"])) return LineError(line, *bad);
      r.output_length = j["output_length"].get<int64_t>();
    }
    if (j.contains("timestamp")) {
      // Milliseconds; within a year of the trace's start is all a replay can wait for.
      const nlohmann::json& t = j["timestamp"];
      if (!t.is_number() || !std::isfinite(t.get<double>()) || t.get<double>() < 0 || t.get<double>() > 3.2e10) {
        return LineError(line, "field 'timestamp' must be milliseconds in [0, 3.2e10]");
      }
      r.arrival_s = t.get<double>() / 1000.0;
    }
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

Result<std::vector<TraceRequest>> ReadAzure(std::istream& in, int64_t limit) {
  std::vector<TraceRequest> out;
  std::string text;
  int64_t column = -1, out_column = -1, time_column = -1;
  double first_time = -1;
  bool too_long = false;
  for (int64_t line = 1; (limit <= 0 || static_cast<int64_t>(out.size()) < limit) && ReadLine(in, text, too_long); ++line) {
    if (too_long) return LineError(line, "longer than 4 MiB (not a trace line)");
    if (!text.empty() && text.back() == '\r') text.pop_back();
    if (text.empty()) continue;
    std::vector<std::string> cells;
    std::stringstream ss(text);
    for (std::string cell; std::getline(ss, cell, ',');) cells.push_back(cell);
    if (column < 0) {
      for (size_t i = 0; i < cells.size(); ++i) {
        if (cells[i].find("ContextTokens") != std::string::npos) column = static_cast<int64_t>(i);
        if (cells[i].find("GeneratedTokens") != std::string::npos) out_column = static_cast<int64_t>(i);
        if (cells[i].find("TIMESTAMP") != std::string::npos) time_column = static_cast<int64_t>(i);
      }
      if (column < 0) return LineError(line, "no 'ContextTokens' column in the header (expected an Azure CSV)");
      continue;
    }
    if (static_cast<int64_t>(cells.size()) <= column) return LineError(line, "field 'ContextTokens' is missing");
    TraceRequest r;
    const std::optional<int64_t> input = ParseInt(cells[static_cast<size_t>(column)]);
    if (!input) return LineError(line, "field 'ContextTokens' is not an integer");
    if (auto bad = BadCount("ContextTokens", *input)) return LineError(line, *bad);
    r.input_length = *input;
    if (out_column >= 0 && static_cast<int64_t>(cells.size()) > out_column) {
      const std::optional<int64_t> output = ParseInt(cells[static_cast<size_t>(out_column)]);
      if (!output) return LineError(line, "field 'GeneratedTokens' is not an integer");
      if (auto bad = BadCount("GeneratedTokens", *output)) return LineError(line, *bad);
      r.output_length = *output;
    }
    if (time_column >= 0 && static_cast<int64_t>(cells.size()) > time_column) {
      // "2023-11-16 18:15:46.6805900": seconds within the day are enough
      // for arrival gaps (the traces span an hour). Parsed strictly: a
      // clock time that is not one is the line's error, not a wait.
      int hh = 0, mm = 0, used = 0;
      double ss = 0;
      const std::string& cell = cells[static_cast<size_t>(time_column)];
      const size_t space = cell.find(' ');
      if (space == std::string::npos ||
          std::sscanf(cell.c_str() + space + 1, "%2d:%2d:%lf%n", &hh, &mm, &ss, &used) != 3 ||
          space + 1 + static_cast<size_t>(used) != cell.size() || hh < 0 || hh > 23 || mm < 0 || mm > 59 ||
          !(ss >= 0 && ss < 61)) {
        return LineError(line, "field 'TIMESTAMP' is '" + cell + "', not 'YYYY-MM-DD hh:mm:ss[.fraction]'");
      }
      const double t = hh * 3600.0 + mm * 60.0 + ss;
      if (first_time < 0) first_time = t;
      r.arrival_s = t - first_time;
      if (r.arrival_s < -43200) r.arrival_s += 86400;  // the trace crossed midnight
    }
    out.push_back(r);
  }
  if (column < 0) return InvalidArgumentError("trace is empty: no header line");
  return out;
}


}  // namespace

Result<std::vector<TraceRequest>> ParseTrace(std::istream& in, TraceFormat format, int64_t limit) {
  PAGEKV_ASSIGN_OR_RETURN(std::vector<TraceRequest> out,
                          format == TraceFormat::kAzure ? ReadAzure(in, limit) : ReadMooncake(in, limit));
  if (!out.empty() && format == TraceFormat::kMooncake) {
    const double first = out.front().arrival_s;
    for (TraceRequest& r : out) r.arrival_s -= first;
  }
  return out;
}

Result<std::vector<TraceRequest>> ReadTrace(const std::string& path, TraceFormat format, int64_t limit,
                                            TraceFormat* resolved) {
  // A FIFO or a device is refused before anything is read (no endless read).
  PAGEKV_ASSIGN_OR_RETURN(RegularFile f, OpenRegularFile(path, "trace"));
  ::close(f.fd);
  std::ifstream in(path);
  if (!in) return NotFoundError("cannot open trace '" + path + "'");
  if (format == TraceFormat::kAuto) {
    format = path.size() >= 4 && path.compare(path.size() - 4, 4, ".csv") == 0 ? TraceFormat::kAzure : TraceFormat::kMooncake;
  }
  if (resolved != nullptr) *resolved = format;
  return ParseTrace(in, format, limit);
}

}  // namespace pagekv::bench
