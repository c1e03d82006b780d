// How a next token is drawn from logits: the options every entry point that
// samples takes (Engine requests, Generate, the server), and their check.
#pragma once

#include <cstdint>
#include <optional>

#include "pagekv/status.h"

namespace pagekv {

struct SamplingOptions {
  float temperature = 0.0f;         // 0 = greedy (argmax, lowest id on ties)
  int32_t top_k = 0;                // 0 = off; else keep the k most likely
  float top_p = 1.0f;               // nucleus: keep the smallest set with mass >= top_p
  float repetition_penalty = 1.0f;  // > 1 discourages tokens already in the sequence
  // Same seed, same tokens; unset: drawn from the operating system, so two
  // unseeded requests sample differently (greedy decoding needs none).
  std::optional<uint64_t> seed;
};
// kInvalidArgument naming the first value out of range (what every entry
// point that samples checks).
Status ValidateSampling(const SamplingOptions& options);

}  // namespace pagekv
