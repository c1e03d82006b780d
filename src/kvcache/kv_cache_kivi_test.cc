// INT4 KIVI layers of the KvCache: sealed groups read back as their codec,
// the f16 tail exactly, forks, truncation, block bytes, Unreserve.
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kvcache/kv_cache_test_util.h"
#include "layout/float16.h"
#include "layout/quantize.h"
#include "pagekv/kv_cache.h"

namespace pagekv {
namespace {

// INT4 KIVI through the cache, against a naive model of the format: a
// sequence's sealed groups read back as decode(encode(group)) of what was
// written, its not-yet-full group exactly (f16). Appends in odd chunks cross
// group and block boundaries; fork copies the tail; truncating into a sealed
// group brings its tokens back into the tail, decoded.
class KiviModel {
 public:
  KiviModel(int32_t heads, int32_t d, int32_t g) : heads_(heads), d_(d), g_(g) {}
  // f16 rows [n][heads][d] of one layer and plane, as float.
  void Append(const std::vector<float>& k, const std::vector<float>& v, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      k_.insert(k_.end(), k.begin() + i * heads_ * d_, k.begin() + (i + 1) * heads_ * d_);
      v_.insert(v_.end(), v.begin() + i * heads_ * d_, v.begin() + (i + 1) * heads_ * d_);
    }
  }
  void Truncate(int64_t len) {
    // Tokens of a sealed group that end up in the tail are the decoded ones.
    const int64_t first = len / g_ * g_;
    if (len % g_ != 0 && first + g_ <= Len()) {
      std::vector<float> k(KValues(first, g_)), v(VValues(first, g_));
      for (float& x : k) x = F16ToF32(F32ToF16(x));  // the tail holds them in f16
      for (float& x : v) x = F16ToF32(F32ToF16(x));
      std::copy(k.begin(), k.end(), k_.begin() + first * heads_ * d_);
      std::copy(v.begin(), v.end(), v_.begin() + first * heads_ * d_);
    }
    k_.resize(static_cast<size_t>(len * heads_ * d_));
    v_.resize(k_.size());
  }
  int64_t Len() const { return static_cast<int64_t>(k_.size()) / (heads_ * d_); }
  // What the cache must return for tokens [first, first + n): sealed groups decoded.
  std::vector<float> KValues(int64_t first, int64_t n) const { return Expected(k_, first, n, true); }
  std::vector<float> VValues(int64_t first, int64_t n) const { return Expected(v_, first, n, false); }

 private:
  std::vector<float> Expected(const std::vector<float>& x, int64_t first, int64_t n, bool keys) const {
    std::vector<float> out(static_cast<size_t>(n * heads_ * d_));
    const int64_t sealed = Len() / g_ * g_;
    std::vector<float> grp(static_cast<size_t>(g_ * d_)), back(grp.size());
    std::vector<std::byte> bytes(static_cast<size_t>(quant::Int4KeyGroupBytes(g_, d_)));
    for (int64_t t = first; t < first + n; ++t) {
      for (int32_t h = 0; h < heads_; ++h) {
        float* o = &out[static_cast<size_t>(((t - first) * heads_ + h) * d_)];
        const float* in = &x[static_cast<size_t>((t * heads_ + h) * d_)];
        if (t >= sealed) {
          std::copy(in, in + d_, o);
          continue;
        }
        if (keys) {
          const int64_t g0 = t / g_ * g_;
          for (int32_t r = 0; r < g_; ++r) {
            std::copy_n(&x[static_cast<size_t>(((g0 + r) * heads_ + h) * d_)], d_, &grp[static_cast<size_t>(r * d_)]);
          }
          quant::EncodeInt4KeyGroup(grp.data(), g_, d_, bytes.data());
          quant::DecodeInt4KeyGroup(bytes.data(), g_, d_, back.data());
          std::copy_n(&back[static_cast<size_t>((t - g0) * d_)], d_, o);
        } else {
          quant::EncodeInt4ValueRow(in, d_, bytes.data());
          quant::DecodeInt4ValueRow(bytes.data(), d_, o);
        }
      }
    }
    return out;
  }
  int32_t heads_, d_, g_;
  std::vector<float> k_, v_;
};

std::vector<uint16_t> ToF16(const std::vector<float>& x) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = F32ToF16(x[i]);
  return out;
}

// Reads layer `layer` of tokens [0, n) of seq and compares with the model
// (each value through f16, as the cache returns it).
void ExpectKivi(const KvCache& cache, SeqId seq, const std::vector<KiviModel>& model, const std::string& when) {
  const KvLayout& l = cache.layout();
  const int64_t n = cache.View(seq)->num_tokens;
  ASSERT_EQ(n, model[0].Len()) << when;
  const int64_t per_layer = n * l.num_heads() * l.row_elems();
  std::vector<uint16_t> k(static_cast<size_t>(per_layer * l.num_layers())), v(k.size());
  ASSERT_TRUE(cache.Read(seq, 0, {n, k.data(), v.data()}).ok());
  for (int32_t layer = 0; layer < l.num_layers(); ++layer) {
    const std::vector<uint16_t> wk = ToF16(model[static_cast<size_t>(layer)].KValues(0, n));
    const std::vector<uint16_t> wv = ToF16(model[static_cast<size_t>(layer)].VValues(0, n));
    for (int64_t i = 0; i < per_layer; ++i) {
      ASSERT_EQ(k[static_cast<size_t>(layer * per_layer + i)], wk[static_cast<size_t>(i)])
          << when << ": layer " << layer << " K value " << i;
      ASSERT_EQ(v[static_cast<size_t>(layer * per_layer + i)], wv[static_cast<size_t>(i)])
          << when << ": layer " << layer << " V value " << i;
    }
  }
}

TEST(KvCacheKiviTest, SealedGroupsReadAsTheirCodecAndTheTailExactly) {
  const int32_t heads = 2, d = 8, g = 8, bl = 16;
  CacheConfig c = Config(bl, DType::kF16, 32, /*layers=*/2, heads, d);
  c.format = KvFormat::Int4Kivi(g);
  auto cache = MakeCache(c);
  ASSERT_EQ(cache->layout().tail_bytes_per_sequence(), 2 * 2 * heads * g * d * 2);
  std::vector<KiviModel> model(2, KiviModel(heads, d, g));
  std::mt19937 rng(21);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  const SeqId seq = cache->AddSequence();
  auto append = [&](SeqId s, std::vector<KiviModel>& m, int64_t n) {
    // Values already on the f16 grid, so the model and the cache start equal.
    std::vector<float> k(static_cast<size_t>(2 * n * heads * d)), v(k.size());
    for (float& x : k) x = F16ToF32(F32ToF16(u(rng)));
    for (float& x : v) x = F16ToF32(F32ToF16(u(rng)));
    const std::vector<uint16_t> k16 = ToF16(k), v16 = ToF16(v);
    ASSERT_TRUE(*cache->Append(s, {n, k16.data(), v16.data()}));
    const auto per_layer = static_cast<std::ptrdiff_t>(n * heads * d);
    for (int32_t layer = 0; layer < 2; ++layer) {
      m[static_cast<size_t>(layer)].Append(std::vector<float>(k.begin() + layer * per_layer, k.begin() + (layer + 1) * per_layer),
                                           std::vector<float>(v.begin() + layer * per_layer, v.begin() + (layer + 1) * per_layer), n);
    }
  };
  for (int64_t n : {3, 5, 1, 9, 15, 2}) {  // 35 tokens: groups sealed at 8, 16, 24, 32
    append(seq, model, n);
    ExpectKivi(*cache, seq, model, "after appending " + std::to_string(n));
  }
  // Fork mid-group: the child copies the tail and the shared partial block.
  const SeqId child = *cache->Fork(seq);
  std::vector<KiviModel> child_model = model;
  append(child, child_model, 7);  // seals the child's group 32..39
  ExpectKivi(*cache, child, child_model, "child");
  ExpectKivi(*cache, seq, model, "parent after the child wrote");
  // Truncate into a sealed group: its first tokens come back, decoded.
  ASSERT_TRUE(cache->Truncate(seq, 19).ok());
  for (KiviModel& m : model) m.Truncate(19);
  ExpectKivi(*cache, seq, model, "truncated to 19");
  append(seq, model, 6);
  ExpectKivi(*cache, seq, model, "appended after the truncation");
  // Whole blocks as bytes: a full block round-trips through ReadBlock / WriteBlock.
  std::vector<std::byte> payload(static_cast<size_t>(cache->block_payload_bytes()));
  ASSERT_TRUE(cache->ReadBlock(cache->View(seq)->blocks[0], payload).ok());
  const SeqId copy = cache->AddSequence();
  ASSERT_TRUE(*cache->Reserve(copy, bl));
  ASSERT_TRUE(cache->WriteBlock(copy, 0, payload).ok());
  std::vector<KiviModel> copy_model = model;
  for (KiviModel& m : copy_model) m.Truncate(bl);
  ExpectKivi(*cache, copy, copy_model, "block copy");
  // Token eviction cannot move KIVI rows.
  std::vector<int32_t> keep(2 * heads, 0);
  EXPECT_EQ(cache->Compact(seq, keep, 1).code(), StatusCode::kUnimplemented);
  cache->CheckInvariants();
}

TEST(KvCacheKiviTest, UnreserveRestoresTheTailExactlyWhereTruncateDecodesIt) {
  const int32_t heads = 2, d = 8, g = 8, bl = 16;
  CacheConfig c = Config(bl, DType::kF16, 32, /*layers=*/2, heads, d);
  c.format = KvFormat::Int4Kivi(g);
  auto cache = MakeCache(c);
  std::vector<KiviModel> model(2, KiviModel(heads, d, g));
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  auto rows = [&](int64_t n, std::vector<float>& k, std::vector<float>& v) {
    k.assign(static_cast<size_t>(2 * n * heads * d), 0.0f);
    v.assign(k.size(), 0.0f);
    for (float& x : k) x = F16ToF32(F32ToF16(u(rng)));
    for (float& x : v) x = F16ToF32(F32ToF16(u(rng)));
  };
  const SeqId seq = cache->AddSequence();
  std::vector<float> k, v;
  rows(5, k, v);  // 5 tokens: all in the f16 tail
  {
    const std::vector<uint16_t> k16 = ToF16(k), v16 = ToF16(v);
    ASSERT_TRUE(*cache->Append(seq, {5, k16.data(), v16.data()}));
    const auto per_layer = static_cast<std::ptrdiff_t>(5 * heads * d);
    for (int32_t layer = 0; layer < 2; ++layer) {
      model[static_cast<size_t>(layer)].Append(std::vector<float>(k.begin() + layer * per_layer, k.begin() + (layer + 1) * per_layer),
                                               std::vector<float>(v.begin() + layer * per_layer, v.begin() + (layer + 1) * per_layer), 5);
    }
  }
  ExpectKivi(*cache, seq, model, "before");
  // 6 more tokens seal the group 0..7 (overwriting the tail's rows), then
  // the reservation is undone: the original f16 rows come back exactly
  // (Truncate would refill them decoded from the sealed group).
  ReserveUndo undo;
  ASSERT_TRUE(*cache->Reserve(seq, 6, &undo));
  EXPECT_TRUE(undo.tail_saved);
  rows(6, k, v);
  const std::vector<uint16_t> k16 = ToF16(k), v16 = ToF16(v);
  const auto per_layer = static_cast<std::ptrdiff_t>(6 * heads * d);
  for (int32_t layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE(cache->WriteLayer(seq, layer, 5, {6, k16.data() + layer * per_layer, v16.data() + layer * per_layer}).ok());
  }
  ASSERT_TRUE(cache->Unreserve(undo).ok());
  ExpectKivi(*cache, seq, model, "after Unreserve");
  cache->CheckInvariants();
  // A reservation inside the group saves nothing (nothing it had is overwritten).
  ReserveUndo small;
  ASSERT_TRUE(*cache->Reserve(seq, 2, &small));
  EXPECT_FALSE(small.tail_saved);
  ASSERT_TRUE(cache->Unreserve(small).ok());
  ExpectKivi(*cache, seq, model, "after a small Unreserve");
}

}  // namespace
}  // namespace pagekv
