// What the engine module's own clients (Generate) use beyond engine.h.
#pragma once

#include <memory>

#include "model/model_loader.h"
#include "pagekv/engine.h"

namespace pagekv {

// Engine::Create for a model already loaded (its path in options is only
// the fingerprint's, with tiers).
Result<std::unique_ptr<Engine>> CreateEngineWithModel(const EngineOptions& options, LoadedModel model);

}  // namespace pagekv
