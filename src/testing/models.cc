// Real-model paths for tests (testing/models.h).
#include "testing/models.h"

#include <cstdlib>

namespace pagekv::testing {
namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

std::string Cached(const char* variable, const char* file) {
  if (std::string p = Env(variable); !p.empty()) return p;
  std::string cache = Env("PAGEKV_MODEL_CACHE");
  if (cache.empty()) cache = Env("XDG_CACHE_HOME").empty() ? Env("HOME") + "/.cache/pagekv/models" : Env("XDG_CACHE_HOME") + "/pagekv/models";
  return cache + "/" + file;
}

}  // namespace

std::string SmolLM2Path() { return Cached("PAGEKV_SMOLLM2", "SmolLM2-135M-Instruct.Q4_1.gguf"); }

std::string Gemma3Path() { return Cached("PAGEKV_GEMMA3", "gemma-3-270m-q4_k_m.gguf"); }

}  // namespace pagekv::testing
