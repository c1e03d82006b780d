// libFuzzer target: arbitrary bytes as the body of a completion or chat
// request (the first byte picks the endpoint and whether an API key's salt
// applies), through the JSON parser and ParseRequest over a real engine on
// stories260K (its tokenizer and chat template). A hostile body must only
// ever give a FieldError or an EngineRequest within the documented bounds:
// any crash, sanitizer report, leak, escaping exception or allocation past
// libFuzzer's -malloc_limit_mb is a bug. Built in the asan build (clang);
// `make test` runs it for 60 s from the repository's root.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "pagekv/engine.h"
#include "server/request.h"

namespace {

pagekv::Engine& TheEngine() {
  static std::unique_ptr<pagekv::Engine> engine = [] {
    pagekv::EngineOptions o;
    o.model_path = "../shared/models/stories260K/stories260K.gguf";
    o.num_blocks = 64;
    o.threads = 1;
    auto e = pagekv::Engine::Create(o);
    if (!e.ok()) {
      std::fprintf(stderr, "request fuzzer: %s (run from the repository root, beside ../shared)\n",
                   e.status().ToString().c_str());
      std::abort();
    }
    return std::move(*e);
  }();
  return *engine;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pagekv;
  if (size == 0) return 0;
  const bool chat = (data[0] & 1) != 0;
  const std::string key_salt = (data[0] & 2) != 0 ? std::string(16, '\x5a') : std::string();
  const nlohmann::json body =
      nlohmann::json::parse(reinterpret_cast<const char*>(data + 1), reinterpret_cast<const char*>(data + size),
                            nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) return 0;
  try {
    const server::ParsedRequest p = server::ParseRequest(body, TheEngine(), key_salt, chat);
    const EngineRequest& r = p.request;
    bool ok = r.max_tokens >= 1 && r.stop.size() <= 4 && std::isfinite(r.sampling.temperature) &&
              r.sampling.temperature >= 0 && r.sampling.top_k >= 0 &&
              (!r.extra.cache_salt || (!r.extra.cache_salt->empty() && r.extra.cache_salt->size() <= 256));
    for (int32_t t : r.prompt) ok = ok && t >= 0;
    for (const std::string& s : r.stop) ok = ok && !s.empty();
    if (!ok) std::abort();
  } catch (const server::FieldError&) {
  }
  return 0;
}
