// libFuzzer target: arbitrary bytes through the trace parsers (the first
// byte picks Mooncake JSON lines or an Azure CSV). A hostile trace must only
// ever give a Status or requests within the stated bounds: any crash,
// sanitizer report, leak, or allocation past libFuzzer's -malloc_limit_mb is
// a bug. Built in the asan build (clang); `make test` runs it for 60 s.
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <string>

#include "bench/trace.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pagekv;
  if (size == 0) return 0;
  const TraceFormat format = data[0] % 2 == 0 ? TraceFormat::kMooncake : TraceFormat::kAzure;
  std::istringstream in(std::string(reinterpret_cast<const char*>(data + 1), size - 1));
  Result<std::vector<bench::TraceRequest>> r = bench::ParseTrace(in, format);
  if (!r.ok()) return 0;
  for (const bench::TraceRequest& q : *r) {
    // What the parsers promise: counts within the bound, finite times.
    if (q.input_length < 0 || q.input_length > (int64_t{1} << 24) || q.output_length < 0 ||
        q.output_length > (int64_t{1} << 24) || !(q.arrival_s > -1e12 && q.arrival_s < 1e12)) {
      std::abort();
    }
  }
  if (!r->empty()) {
    std::vector<int32_t> tokens;
    bench::TraceRequest first = r->front();
    first.input_length = std::min<int64_t>(first.input_length, 4096);
    if (!first.hash_ids.empty()) first.hash_ids.resize(static_cast<size_t>((first.input_length + 511) / 512));
    bench::TraceTokens(first, 0, 512, tokens);
  }
  return 0;
}
