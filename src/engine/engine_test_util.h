// What the engine's tests on stories260K share (engine_test.cc,
// engine_shared_test.cc): the model, small-pool options and a prompt's
// tokens generated alone, the reference they compare with.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "pagekv/engine.h"

namespace pagekv::engine_test {

inline constexpr const char* kGguf = "../shared/models/stories260K/stories260K.gguf";

inline EngineOptions Options(int64_t blocks, int64_t step_tokens = 256) {
  EngineOptions o;
  o.model_path = kGguf;
  o.block_len = 8;
  o.num_blocks = blocks;
  o.max_step_tokens = step_tokens;
  o.watermark_blocks = 0;
  return o;
}

inline const std::vector<std::string> kPrompts = {
    "Once upon a time", "Lily and Ben went to the park", "The little cat", "One day, a boy named Tom",
    "Once upon a time, in a big forest, there lived a bear", "Sara had a red ball"};

// One prompt generated alone on an ample pool: the reference.
inline std::vector<int32_t> AloneOne(const std::string& prompt, int32_t max_tokens) {
  auto e = std::move(*Engine::Create(Options(256)));
  EngineRequest r;
  r.prompt = e->Encode(prompt);
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  const RequestId id = *e->Submit(r);
  EXPECT_TRUE(e->RunUntilIdle().ok());
  return e->Wait(id).tokens;
}

}  // namespace pagekv::engine_test
