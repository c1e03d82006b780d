// Shared by the request fuzzers: a real engine on stories260K (its
// tokenizer and chat template), and the check that a hostile body gives
// either a FieldError or an EngineRequest within the documented bounds
// (anything else aborts, which libFuzzer reports).
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "pagekv/engine.h"
#include "server/request.h"

namespace pagekv::server::fuzz {

inline Engine& TheEngine() {
  static std::unique_ptr<Engine> engine = [] {
    EngineOptions o;
    o.model_path = "../shared/models/stories260K/stories260K.gguf";
    o.num_blocks = 64;
    o.threads = 1;
    auto e = Engine::Create(o);
    if (!e.ok()) {
      std::fprintf(stderr, "request fuzzer: %s (run from the repository root, beside ../shared)\n",
                   e.status().ToString().c_str());
      std::abort();
    }
    return std::move(*e);
  }();
  return *engine;
}

// llama: the body is llama-server's /completion, translated first.
inline void CheckBody(const nlohmann::json& body, bool chat, const std::string& key_salt, bool llama = false) {
  if (body.is_discarded() || !body.is_object()) return;
  try {
    bool until_context = false;
    const nlohmann::json translated = llama ? LlamaCompletionBody(body, &until_context) : body;
    const ParsedRequest p = ParseRequest(translated, TheEngine(), key_salt, chat && !llama, until_context);
    if (p.choices.empty() || p.choices.size() > static_cast<size_t>(kMaxChoices) || p.echo.size() != p.choices.size() ||
        p.n < 1 || p.choices.size() % static_cast<size_t>(p.n) != 0) {
      std::abort();
    }
    for (const EngineRequest& r : p.choices) {
      bool ok = r.max_tokens >= 1 && r.stop.size() <= 4 && std::isfinite(r.sampling.temperature) &&
                r.sampling.temperature >= 0 && r.sampling.top_k >= 0 &&
                (!r.extra.cache_salt || (!r.extra.cache_salt->empty() && r.extra.cache_salt->size() <= 256));
      for (int32_t t : r.prompt) ok = ok && t >= 0;
      for (const std::string& s : r.stop) ok = ok && !s.empty();
      if (!ok) std::abort();
    }
  } catch (const FieldError&) {
  }
}

}  // namespace pagekv::server::fuzz
