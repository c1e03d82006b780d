// How a next token is drawn from logits: the options every entry point that
// samples takes (Engine requests, Generate, the server), and their check.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "pagekv/status.h"

namespace pagekv {

struct SamplingOptions {
  float temperature = 0.0f;         // 0 = greedy (argmax, lowest id on ties)
  int32_t top_k = 0;                // 0 = off; else keep the k most likely
  float top_p = 1.0f;               // nucleus: keep the smallest set with mass >= top_p
  float repetition_penalty = 1.0f;  // > 1 discourages tokens already in the sequence
  // OpenAI's penalties over the tokens generated so far (not the prompt):
  // each logit less presence_penalty if the token occurred and
  // frequency_penalty times its count. In [-2, 2]; 0 = off.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // Added to the logits of these token ids before anything else (OpenAI's
  // logit_bias, values in [-100, 100]; -100 in effect bans a token).
  std::vector<std::pair<int32_t, float>> logit_bias;
  // Same seed, same tokens; unset: drawn from the operating system, so two
  // unseeded requests sample differently (greedy decoding needs none).
  std::optional<uint64_t> seed;
};
// kInvalidArgument naming the first value out of range (what every entry
// point that samples checks).
Status ValidateSampling(const SamplingOptions& options);

}  // namespace pagekv
