#include "testing/reference_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace pagekv::testing {

std::vector<double> ReferenceAttention(const ReferenceShape& s, const std::vector<double>& q,
                                       int64_t num_queries, const std::vector<double>& k,
                                       const std::vector<double>& v, int64_t num_tokens,
                                       std::vector<double>* weights, int64_t score_queries) {
  const int64_t d = s.head_dim;
  const int64_t group = s.num_q_heads / s.num_kv_heads;
  const double scale = s.scale != 0 ? s.scale : 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> out(static_cast<size_t>(num_queries * s.num_q_heads * d), 0.0);
  std::vector<double> logits(static_cast<size_t>(num_tokens));
  if (weights != nullptr) weights->assign(static_cast<size_t>(s.num_kv_heads * num_tokens), 0.0);
  const int64_t first_scored = score_queries == 0 ? 0 : num_queries - score_queries;
  for (int64_t j = 0; j < num_queries; ++j) {
    const int64_t last = num_tokens - num_queries + j;  // inclusive
    const int64_t first = s.window > 0 ? std::max<int64_t>(0, last - s.window + 1) : 0;
    for (int64_t qh = 0; qh < s.num_q_heads; ++qh) {
      const int64_t kh = qh / group;
      const double* qv = &q[static_cast<size_t>((j * s.num_q_heads + qh) * d)];
      double max_logit = -std::numeric_limits<double>::infinity();
      for (int64_t t = first; t <= last; ++t) {
        const double* kv = &k[static_cast<size_t>((t * s.num_kv_heads + kh) * d)];
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += qv[i] * kv[i];
        double x = dot * scale;
        if (s.softcap > 0) x = s.softcap * std::tanh(x / s.softcap);
        logits[static_cast<size_t>(t)] = x;
        max_logit = std::max(max_logit, x);
      }
      double sum = 0;
      for (int64_t t = first; t <= last; ++t) {
        logits[static_cast<size_t>(t)] = std::exp(logits[static_cast<size_t>(t)] - max_logit);
        sum += logits[static_cast<size_t>(t)];
      }
      double* o = &out[static_cast<size_t>((j * s.num_q_heads + qh) * d)];
      for (int64_t t = first; t <= last; ++t) {
        const double w = logits[static_cast<size_t>(t)] / sum;
        if (weights != nullptr && j >= first_scored) (*weights)[static_cast<size_t>(kh * num_tokens + t)] += w;
        const double* vv = &v[static_cast<size_t>((t * s.num_kv_heads + kh) * d)];
        for (int64_t i = 0; i < d; ++i) o[i] += w * vv[i];
      }
    }
  }
  return out;
}

double MaxRowRelError(const float* out, const std::vector<double>& ref, int64_t rows, int32_t d) {
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double err = 0, mag = 1e-6;
    for (int32_t x = 0; x < d; ++x) {
      const double o = out[r * d + x];
      if (std::isnan(o)) return INFINITY;
      err = std::max(err, std::fabs(o - ref[static_cast<size_t>(r * d + x)]));
      mag = std::max(mag, std::fabs(ref[static_cast<size_t>(r * d + x)]));
    }
    worst = std::max(worst, err / mag);
  }
  return worst;
}

}  // namespace pagekv::testing
