// Where the tests find the real models scripts/fetch-model.sh caches (make
// test fetches them first): $PAGEKV_SMOLLM2, else the fetch script's cache
// ($PAGEKV_MODEL_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/pagekv/models).
#pragma once

#include <string>

namespace pagekv::testing {

// SmolLM2-135M-Instruct.Q4_1.gguf (it may not exist: callers check).
std::string SmolLM2Path();

}  // namespace pagekv::testing
