// Real-model paths for tests (testing/models.h).
#include "testing/models.h"

#include <cstdlib>

namespace pagekv::testing {
namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

}  // namespace

std::string SmolLM2Path() {
  if (std::string p = Env("PAGEKV_SMOLLM2"); !p.empty()) return p;
  std::string cache = Env("PAGEKV_MODEL_CACHE");
  if (cache.empty()) cache = Env("XDG_CACHE_HOME").empty() ? Env("HOME") + "/.cache/pagekv/models" : Env("XDG_CACHE_HOME") + "/pagekv/models";
  return cache + "/SmolLM2-135M-Instruct.Q4_1.gguf";
}

}  // namespace pagekv::testing
