#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

namespace pagekv {

uint64_t Sampler::FreshSeed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

Status Sampler::Validate(const SamplingOptions& o) {
  if (!(o.temperature >= 0.0f) || o.temperature > 100.0f) {
    return InvalidArgumentError("temperature " + std::to_string(o.temperature) + ": must be in [0, 100] (0 = greedy)");
  }
  if (o.top_k < 0) return InvalidArgumentError("top_k " + std::to_string(o.top_k) + ": must be >= 0 (0 = off)");
  if (!(o.top_p > 0.0f && o.top_p <= 1.0f)) {
    return InvalidArgumentError("top_p " + std::to_string(o.top_p) + ": must be in (0, 1]");
  }
  if (!(o.repetition_penalty >= 1.0f && o.repetition_penalty <= 10.0f)) {
    return InvalidArgumentError("repetition_penalty " + std::to_string(o.repetition_penalty) +
                                ": must be in [1, 10] (1 = off)");
  }
  if (!(o.presence_penalty >= -2.0f && o.presence_penalty <= 2.0f)) {
    return InvalidArgumentError("presence_penalty " + std::to_string(o.presence_penalty) + ": must be in [-2, 2] (0 = off)");
  }
  if (!(o.frequency_penalty >= -2.0f && o.frequency_penalty <= 2.0f)) {
    return InvalidArgumentError("frequency_penalty " + std::to_string(o.frequency_penalty) + ": must be in [-2, 2] (0 = off)");
  }
  if (o.logit_bias.size() > 1024) {
    return InvalidArgumentError(std::to_string(o.logit_bias.size()) + " logit_bias entries: at most 1024");
  }
  for (const auto& [id, bias] : o.logit_bias) {
    if (id < 0) return InvalidArgumentError("logit_bias: token id " + std::to_string(id) + " is negative");
    if (!(bias >= -100.0f && bias <= 100.0f)) {
      return InvalidArgumentError("logit_bias of token " + std::to_string(id) + ": " + std::to_string(bias) +
                                  " must be in [-100, 100]");
    }
  }
  return Status::Ok();
}

Status ValidateSampling(const SamplingOptions& options) { return Sampler::Validate(options); }

namespace {

// The lowest index of the largest value (std::max_element's answer): eight
// independent running maxima the compiler turns into one vector max, then
// the first index holding it. ~5x std::max_element over a 32K vocabulary.
int32_t ArgMax(std::span<const float> v) {
  const size_t n = v.size();
  float m[8];
  for (float& x : m) x = -std::numeric_limits<float>::infinity();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (size_t j = 0; j < 8; ++j) m[j] = v[i + j] > m[j] ? v[i + j] : m[j];
  }
  for (; i < n; ++i) m[0] = v[i] > m[0] ? v[i] : m[0];
  float best = m[0];
  for (float x : m) best = x > best ? x : best;
  for (size_t j = 0; j < n; ++j) {
    if (v[j] == best) return static_cast<int32_t>(j);
  }
  // Every value NaN or -inf: what std::max_element returns, the first.
  return 0;
}

}  // namespace

int32_t Sampler::Sample(std::span<const float> logits, std::span<const int32_t> history, size_t generated_from) {
  const auto n = static_cast<int32_t>(logits.size());
  const bool penalties = options_.presence_penalty != 0.0f || options_.frequency_penalty != 0.0f;
  if (options_.temperature == 0.0f && options_.repetition_penalty == 1.0f && !penalties && options_.logit_bias.empty()) {
    return ArgMax(logits);  // no copy
  }
  scratch_.assign(logits.begin(), logits.end());
  for (const auto& [id, bias] : options_.logit_bias) {
    if (id < n) scratch_[static_cast<size_t>(id)] += bias;  // ids past the vocabulary: refused at submission
  }
  if (penalties) {
    counts_.assign(static_cast<size_t>(n), 0);
    for (size_t i = std::min(generated_from, history.size()); i < history.size(); ++i) {
      if (history[i] >= 0 && history[i] < n) ++counts_[static_cast<size_t>(history[i])];
    }
    for (size_t i = std::min(generated_from, history.size()); i < history.size(); ++i) {
      const int32_t id = history[i];
      if (id < 0 || id >= n || counts_[static_cast<size_t>(id)] == 0) continue;
      scratch_[static_cast<size_t>(id)] -= options_.presence_penalty +
                                           options_.frequency_penalty * static_cast<float>(counts_[static_cast<size_t>(id)]);
      counts_[static_cast<size_t>(id)] = 0;  // once per id
    }
  }
  if (options_.repetition_penalty != 1.0f) {
    for (int32_t id : history) {
      if (id < 0 || id >= n) continue;
      float& l = scratch_[static_cast<size_t>(id)];
      l = l > 0 ? l / options_.repetition_penalty : l * options_.repetition_penalty;
    }
  }
  if (options_.temperature == 0.0f) return ArgMax(scratch_);
  // Candidates sorted by logit (ties by id), cut by top-k.
  order_.resize(static_cast<size_t>(n));
  std::iota(order_.begin(), order_.end(), 0);
  const int32_t k = options_.top_k > 0 ? std::min(options_.top_k, n) : n;
  auto better = [&](int32_t a, int32_t b) {
    const float la = scratch_[static_cast<size_t>(a)], lb = scratch_[static_cast<size_t>(b)];
    return la > lb || (la == lb && a < b);
  };
  std::partial_sort(order_.begin(), order_.begin() + k, order_.end(), better);
  order_.resize(static_cast<size_t>(k));
  // Softmax at the temperature over the candidates.
  const float mx = scratch_[static_cast<size_t>(order_[0])];
  std::vector<double> p(order_.size());
  double sum = 0;
  for (size_t i = 0; i < order_.size(); ++i) {
    p[i] = std::exp(static_cast<double>(scratch_[static_cast<size_t>(order_[i])] - mx) / options_.temperature);
    sum += p[i];
  }
  // Top-p: the smallest prefix whose mass reaches top_p.
  size_t keep = order_.size();
  if (options_.top_p < 1.0f) {
    double mass = 0;
    for (size_t i = 0; i < order_.size(); ++i) {
      mass += p[i] / sum;
      if (mass >= options_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept = 0;
  for (size_t i = 0; i < keep; ++i) kept += p[i];
  const double r = std::uniform_real_distribution<double>(0.0, kept)(rng_);
  double acc = 0;
  for (size_t i = 0; i < keep; ++i) {
    acc += p[i];
    if (r < acc) return order_[i];
  }
  return order_[keep - 1];
}

}  // namespace pagekv
