// Sampler: picks the next token from logits. Greedy, temperature, top-k,
// top-p and a repetition penalty; a seeded generator per sampler, so the
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
  // sequence (for the repetition penalty). Modifies nothing it is given.
  int32_t Sample(std::span<const float> logits, std::span<const int32_t> history);

 private:
  SamplingOptions options_;
  std::mt19937_64 rng_;
  std::vector<float> scratch_;
  std::vector<int32_t> order_;
};

}  // namespace pagekv
