// Where the tests find the real models scripts/fetch-model.sh caches (make
// test fetches them first): $PAGEKV_SMOLLM2 / $PAGEKV_GEMMA3, else the fetch script's cache
// ($PAGEKV_MODEL_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/pagekv/models).
#pragma once

#include <string>

namespace pagekv::testing {

// SmolLM2-135M-Instruct.Q4_1.gguf (it may not exist: callers check).
std::string SmolLM2Path();

// gemma-3-270m-q4_k_m.gguf ($PAGEKV_GEMMA3, else the fetch script's cache).
std::string Gemma3Path();

}  // namespace pagekv::testing
