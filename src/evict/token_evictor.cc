// TokenEvictor (include/pagekv/eviction.h).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "base/check.h"
#include "pagekv/eviction.h"

namespace pagekv {
namespace {

// ceil(budget * n), at least 1 for n > 0; a hair below the product first so
// that 0.2 * 5 keeps 1, not 2.
int64_t Budgeted(double budget, int64_t n) {
  if (n <= 0) return 0;
  const auto k = static_cast<int64_t>(std::ceil(budget * static_cast<double>(n) - 1e-9));
  return std::clamp<int64_t>(k, 1, n);
}

}  // namespace

std::string_view EvictionPolicyName(EvictionPolicy p) {
  switch (p) {
    case EvictionPolicy::kNone: return "none";
    case EvictionPolicy::kStreaming: return "streaming";
    case EvictionPolicy::kH2O: return "h2o";
    case EvictionPolicy::kSnapKV: return "snapkv";
  }
  return "?";
}

Status EvictionOptions::Validate() const {
  if (!(budget > 0 && budget <= 1)) {
    return InvalidArgumentError("eviction budget " + std::to_string(budget) +
                                " is outside (0, 1]: it is the fraction of tokens kept (0.2 keeps 20%)");
  }
  if (sink_tokens < 0) return InvalidArgumentError("eviction sink_tokens " + std::to_string(sink_tokens) + " is negative");
  if (!(recent_fraction >= 0 && recent_fraction <= 1)) {
    return InvalidArgumentError("eviction recent_fraction " + std::to_string(recent_fraction) + " is outside [0, 1]");
  }
  if (window < 1) return InvalidArgumentError("eviction window " + std::to_string(window) + " must be at least 1");
  if (pool_kernel < 1 || pool_kernel % 2 == 0) {
    return InvalidArgumentError("eviction pool_kernel " + std::to_string(pool_kernel) + " must be odd and >= 1");
  }
  return Status::Ok();
}

Result<EvictionOptions> ParseEvictionPolicy(std::string_view name, double budget) {
  EvictionOptions o;
  if (name == "none") {
    o.policy = EvictionPolicy::kNone;
  } else if (name == "streaming") {
    o.policy = EvictionPolicy::kStreaming;
  } else if (name == "h2o") {
    o.policy = EvictionPolicy::kH2O;
  } else if (name == "snapkv") {
    o.policy = EvictionPolicy::kSnapKV;
  } else {
    return InvalidArgumentError("unknown eviction policy '" + std::string(name) +
                                "': use none, streaming, h2o or snapkv");
  }
  o.budget = budget;
  PAGEKV_RETURN_IF_ERROR(o.Validate());
  return o;
}

Result<std::unique_ptr<TokenEvictor>> TokenEvictor::Create(const EvictionOptions& options, const KvLayout& layout) {
  PAGEKV_RETURN_IF_ERROR(options.Validate());
  // An MLA latent cache is one list per layer (its one latent row per token
  // is what every query head reads; the kernels' weights are summed over
  // all of them).
  for (int32_t l = 0; l < layout.num_layers() && options.policy != EvictionPolicy::kNone; ++l) {
    const KvFormat& f = layout.format(l);
    if (!f.IsPlainFloat() && !f.IsStoredQuantized(layout.row_elems())) {
      return UnimplementedError("token eviction moves whole rows; format " + f.ToString() +
                                " shares scales between tokens");
    }
  }
  return std::unique_ptr<TokenEvictor>(new TokenEvictor(options, layout));
}

TokenEvictor::TokenEvictor(const EvictionOptions& options, const KvLayout& layout)
    : options_(options), layers_(layout.num_layers()), heads_(layout.num_heads()) {
  const auto lists = static_cast<size_t>(layers_) * static_cast<size_t>(heads_);
  positions_.resize(lists);
  if (options_.policy == EvictionPolicy::kH2O) acc_.resize(lists);
}

StepScores TokenEvictor::BeginStep(int64_t cached, int64_t n, bool prompt_ends) {
  step_n_ = n;
  step_prompt_ends_ = prompt_ends;
  const bool want = options_.policy == EvictionPolicy::kH2O ||
                    (options_.policy == EvictionPolicy::kSnapKV && prompt_ends && !prompt_done_);
  if (!want) {
    step_.clear();
    return {};
  }
  step_.assign(positions_.size() * static_cast<size_t>(cached + n), 0.0f);
  const int64_t queries = options_.policy == EvictionPolicy::kH2O ? 0 : std::min<int64_t>(options_.window, n);
  return {step_.data(), queries};
}

Status TokenEvictor::EndStep(KvCache& cache, SeqId seq) {
  PAGEKV_ASSIGN_OR_RETURN(SequenceView view, cache.View(seq));
  if (step_n_ <= 0 || view.num_tokens != cached_ + step_n_) {
    return FailedPreconditionError("eviction: the sequence holds " + std::to_string(view.num_tokens) +
                                   " tokens; expected " + std::to_string(cached_ + step_n_) +
                                   " (call BeginStep before each step and EndStep after it)");
  }
  const int64_t total = cached_ + step_n_;
  const bool scored = !step_.empty();
  for (size_t li = 0; li < positions_.size(); ++li) {
    for (int64_t i = 0; i < step_n_; ++i) positions_[li].push_back(seen_ + i);
    if (options_.policy == EvictionPolicy::kH2O) {
      std::vector<float>& a = acc_[li];
      a.resize(static_cast<size_t>(total), 0.0f);
      const float* s = step_.data() + li * static_cast<size_t>(total);
      for (int64_t t = 0; t < total; ++t) a[static_cast<size_t>(t)] += s[t];
    }
  }
  seen_ += step_n_;
  cached_ = total;
  step_n_ = 0;

  switch (options_.policy) {
    case EvictionPolicy::kNone:
      return Status::Ok();
    case EvictionPolicy::kStreaming: {
      const int64_t k = Budgeted(options_.budget, seen_);
      if (cached_ <= k) return Status::Ok();
      ChooseStreaming(k);
      return Apply(cache, seq, k);
    }
    case EvictionPolicy::kH2O: {
      const int64_t k = Budgeted(options_.budget, seen_);
      if (cached_ <= k) return Status::Ok();
      const auto recent = std::clamp<int64_t>(
          static_cast<int64_t>(std::ceil(options_.recent_fraction * static_cast<double>(k) - 1e-9)), 0, k);
      ChooseByScore(k, recent, acc_);
      return Apply(cache, seq, k);
    }
    case EvictionPolicy::kSnapKV: {
      if (!step_prompt_ends_ || prompt_done_) return Status::Ok();
      prompt_done_ = true;
      const int64_t k = Budgeted(options_.budget, seen_);
      if (cached_ <= k || !scored) return Status::Ok();
      // Max-pool the window's weights over neighbouring positions, so that a
      // kept token brings its neighbours' context (slots are in position
      // order: nothing was evicted before the prompt ended).
      const int64_t half = options_.pool_kernel / 2;
      std::vector<std::vector<float>> pooled(positions_.size(), std::vector<float>(static_cast<size_t>(cached_)));
      for (size_t li = 0; li < positions_.size(); ++li) {
        const float* s = step_.data() + li * static_cast<size_t>(cached_);
        for (int64_t t = 0; t < cached_; ++t) {
          float m = s[t];
          for (int64_t u = std::max<int64_t>(0, t - half); u <= std::min(cached_ - 1, t + half); ++u) m = std::max(m, s[u]);
          pooled[li][static_cast<size_t>(t)] = m;
        }
      }
      ChooseByScore(k, std::min<int64_t>(options_.window, k), pooled);
      return Apply(cache, seq, k);
    }
  }
  return Status::Ok();
}

void TokenEvictor::ChooseStreaming(int64_t k) {
  const int64_t sinks = std::min<int64_t>(options_.sink_tokens, std::max<int64_t>(0, k - 1));
  keep_.clear();
  std::vector<int32_t> order(static_cast<size_t>(cached_));
  for (const std::vector<int64_t>& pos : positions_) {
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return pos[static_cast<size_t>(a)] < pos[static_cast<size_t>(b)];
    });
    keep_.insert(keep_.end(), order.begin(), order.begin() + sinks);
    keep_.insert(keep_.end(), order.end() - (k - sinks), order.end());
  }
}

void TokenEvictor::ChooseByScore(int64_t k, int64_t recent, const std::vector<std::vector<float>>& score) {
  keep_.clear();
  std::vector<int32_t> order(static_cast<size_t>(cached_));
  for (size_t li = 0; li < positions_.size(); ++li) {
    const std::vector<int64_t>& pos = positions_[li];
    const std::vector<float>& sc = score[li];
    std::iota(order.begin(), order.end(), 0);
    // Latest positions first: the recent window is the head of the order.
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return pos[static_cast<size_t>(a)] > pos[static_cast<size_t>(b)];
    });
    // The rest by score, highest first (ties: the earlier position).
    const auto rest = order.begin() + recent;
    std::partial_sort(rest, rest + (k - recent), order.end(), [&](int32_t a, int32_t b) {
      const float x = sc[static_cast<size_t>(a)], y = sc[static_cast<size_t>(b)];
      return x != y ? x > y : pos[static_cast<size_t>(a)] < pos[static_cast<size_t>(b)];
    });
    keep_.insert(keep_.end(), order.begin(), order.begin() + k);
  }
}

Status TokenEvictor::Apply(KvCache& cache, SeqId seq, int64_t k) {
  PAGEKV_RETURN_IF_ERROR(cache.Compact(seq, keep_, k));
  for (size_t li = 0; li < positions_.size(); ++li) {
    const std::span<const int32_t> list(keep_.data() + li * static_cast<size_t>(k), static_cast<size_t>(k));
    for (const auto& [from, to] : CompactionMoves(list)) {
      positions_[li][static_cast<size_t>(to)] = positions_[li][static_cast<size_t>(from)];
      if (!acc_.empty()) acc_[li][static_cast<size_t>(to)] = acc_[li][static_cast<size_t>(from)];
      ++stats_.rows_moved;
    }
    positions_[li].resize(static_cast<size_t>(k));
    if (!acc_.empty()) acc_[li].resize(static_cast<size_t>(k));
  }
  stats_.tokens_evicted += cached_ - k;
  ++stats_.compactions;
  cached_ = k;
  return Status::Ok();
}

void TokenEvictor::CheckInvariants() const {
  const size_t lists = static_cast<size_t>(layers_) * static_cast<size_t>(heads_);
  PAGEKV_CHECK_MSG(positions_.size() == lists, "evictor: not one position list per (layer, head)");
  PAGEKV_CHECK_MSG(cached_ <= seen_, "evictor: more cached slots than tokens ever appended");
  for (const std::vector<int64_t>& p : positions_) {
    PAGEKV_CHECK_MSG(static_cast<int64_t>(p.size()) == cached_, "evictor: a position list's length is not cached()");
    std::vector<int64_t> sorted = p;
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 0; i < sorted.size(); ++i) {
      PAGEKV_CHECK_MSG(sorted[i] >= 0 && sorted[i] < seen_, "evictor: a position outside [0, seen())");
      PAGEKV_CHECK_MSG(i == 0 || sorted[i - 1] < sorted[i], "evictor: a position held by two slots");
    }
  }
  if (!acc_.empty()) {
    PAGEKV_CHECK_MSG(acc_.size() == lists, "evictor: not one score list per (layer, head)");
    for (const std::vector<float>& a : acc_) {
      PAGEKV_CHECK_MSG(static_cast<int64_t>(a.size()) == cached_, "evictor: a score list's length is not cached()");
    }
  }
}

std::span<const int64_t> TokenEvictor::Positions(int32_t layer, int32_t head) const {
  return positions_[static_cast<size_t>(layer) * static_cast<size_t>(heads_) + static_cast<size_t>(head)];
}

}  // namespace pagekv
