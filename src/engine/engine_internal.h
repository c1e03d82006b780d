// What the engine module's own clients (Generate) use beyond engine.h.
#pragma once

#include <memory>

#include "model/model_loader.h"
#include "pagekv/engine.h"

namespace pagekv {

// Engine::Create for a model already loaded (its path in options is only
// the fingerprint's, with tiers).
Result<std::unique_ptr<Engine>> CreateEngineWithModel(const EngineOptions& options, LoadedModel model);

// The cache geometry the engine builds for `model` (one block: num_blocks 1),
// a hybrid cache's windows included when options.kv_groups picks one.
// Error: an explicit hybrid cache with what it does not support yet.
Result<CacheConfig> EngineCacheGeometry(const EngineOptions& options, const Model& model);

}  // namespace pagekv
