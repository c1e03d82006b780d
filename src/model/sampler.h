// Sampler: picks the next token from logits. Greedy, temperature, top-k,
// top-p, a repetition penalty, presence / frequency penalties and logit bias; a seeded generator per sampler, so the
// same seed gives the same tokens.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "pagekv/sampling.h"

namespace pagekv {

class Sampler {
 public:
  // An unset seed is drawn from the operating system (std::random_device).
  explicit Sampler(const SamplingOptions& options)
      : options_(options), rng_(options.seed.has_value() ? *options.seed : FreshSeed()) {}
  static uint64_t FreshSeed();

  // Checks the options; the error names the field and its accepted range.
  static Status Validate(const SamplingOptions& options);

  // REQUIRES: logits.size() > 0. `history` holds the ids already in the
  // sequence (the repetition penalty looks at all of them), of which those
  // from `generated_from` on were generated (the presence and frequency
  // penalties count only those). Modifies nothing it is given.
  int32_t Sample(std::span<const float> logits, std::span<const int32_t> history, size_t generated_from = 0);

 private:
  SamplingOptions options_;
  std::mt19937_64 rng_;
  std::vector<float> scratch_;
  std::vector<int32_t> order_;
  std::vector<int32_t> counts_;  // per id, in the generated tokens (penalties)
};

}  // namespace pagekv
