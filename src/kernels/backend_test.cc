// The CPU backend's block moves against the layout's own arithmetic: each
// slab found where KvLayout::SlabOffset says, in payload order, copies on
// write taking exactly the filled rows (whole slabs for INT4 KIVI), and an
// arena of the size asked.
#include "kernels/backend.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

namespace pagekv {
namespace {

KvLayout Layout(KvFormat format, int32_t layers = 3) {
  CacheConfig c;
  c.num_layers = layers;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.block_len = 16;
  c.format = format;
  c.num_blocks = 6;
  return *KvLayout::Create(c);
}

// Every byte of the arena gets a value of its own.
std::unique_ptr<KvArena> PatternedArena(const KvLayout& layout) {
  auto arena = *CpuBackend().AllocateArena({.size_bytes = layout.total_bytes()});
  for (int64_t i = 0; i < layout.total_bytes(); ++i) arena->data()[i] = static_cast<std::byte>((i * 131 + 7) % 251);
  return arena;
}

int64_t PayloadBytes(const KvLayout& l) { return l.bytes_per_block() - l.padding_bytes_per_block(); }

TEST(CpuBackendTest, BlockTransfersFollowTheLayoutInPayloadOrderAndRoundTrip) {
  const KvLayout layout = Layout(KvFormat::Plain(DType::kF16));
  auto arena = PatternedArena(layout);
  const Backend& be = CpuBackend();
  EXPECT_EQ(be.name(), "cpu");
  std::vector<std::byte> host(static_cast<size_t>(PayloadBytes(layout)));
  be.BlockToHost(layout, arena->data(), BlockId{4}, host);
  size_t at = 0;
  for (int32_t l = 0; l < layout.num_layers(); ++l) {
    for (int32_t p = 0; p < layout.num_planes(); ++p) {
      for (int32_t h = 0; h < layout.num_heads(); ++h) {
        const auto slab = static_cast<size_t>(layout.slab_bytes(l, p));
        ASSERT_EQ(std::memcmp(host.data() + at, arena->data() + layout.SlabOffset(l, p, h, 4), slab), 0)
            << "layer " << l << " plane " << p << " head " << h;
        at += slab;
      }
    }
  }
  EXPECT_EQ(at, host.size());
  // Into another block, and nothing else changes.
  std::vector<std::byte> before(arena->data(), arena->data() + layout.total_bytes());
  be.HostToBlock(layout, arena->data(), BlockId{1}, host);
  std::vector<std::byte> back(host.size());
  be.BlockToHost(layout, arena->data(), BlockId{1}, back);
  EXPECT_EQ(back, host);
  for (int64_t b = 0; b < layout.num_blocks(); ++b) {
    if (b == 1) continue;
    std::vector<std::byte> now(host.size()), was(host.size());
    be.BlockToHost(layout, arena->data(), BlockId{static_cast<int32_t>(b)}, now);
    be.BlockToHost(layout, before.data(), BlockId{static_cast<int32_t>(b)}, was);
    EXPECT_EQ(now, was) << "block " << b << " changed";
  }
}

TEST(CpuBackendTest, CopyOnWriteTakesTheFilledRowsOnlyAndWholeKiviSlabs) {
  for (const KvFormat& format : {KvFormat::Plain(DType::kF32), KvFormat::Int4Kivi(16)}) {
    const KvLayout layout = Layout(format, 2);
    auto arena = PatternedArena(layout);
    const std::vector<std::byte> before(arena->data(), arena->data() + layout.total_bytes());
    const BlockCopy copies[] = {{BlockId{2}, BlockId{5}, 5}, {BlockId{0}, BlockId{3}, 16}};
    CpuBackend().CopyBlocks(layout, arena->data(), copies);
    for (const BlockCopy& c : copies) {
      for (int32_t l = 0; l < layout.num_layers(); ++l) {
        for (int32_t p = 0; p < layout.num_planes(); ++p) {
          for (int32_t h = 0; h < layout.num_heads(); ++h) {
            const int64_t slab = layout.slab_bytes(l, p);
            const int64_t copied = layout.kivi(l) ? slab : c.filled * layout.row_bytes(l);
            const int64_t dst = layout.SlabOffset(l, p, h, ToInt(c.dst)), src = layout.SlabOffset(l, p, h, ToInt(c.src));
            EXPECT_EQ(std::memcmp(arena->data() + dst, before.data() + src, static_cast<size_t>(copied)), 0)
                << format.ToString() << " layer " << l;
            EXPECT_EQ(std::memcmp(arena->data() + dst + copied, before.data() + dst + copied,
                                  static_cast<size_t>(slab - copied)),
                      0)
                << format.ToString() << ": rows past the filled ones were written";
          }
        }
      }
    }
  }
}

TEST(CpuBackendTest, ArenaSizeIsCheckedAndMathForwardsToTheKernels) {
  EXPECT_EQ(CpuBackend().AllocateArena({.size_bytes = 0}).status().code(), StatusCode::kInvalidArgument);
  // One product through the backend and directly: the same bits.
  std::vector<float> w(8 * 32), x(3 * 32), a(3 * 8), b(3 * 8);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(static_cast<int>(i * 37 % 17) - 8) / 8.0f;
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i * 11 % 13) - 6) / 4.0f;
  const WeightMatrix m{reinterpret_cast<const std::byte*>(w.data()), WeightType::kF32, 8, 32};
  ASSERT_TRUE(CpuBackend().MatMul(m, x.data(), 3, a.data(), 1, Activations::kF32).ok());
  ASSERT_TRUE(MatMul(m, x.data(), 3, b.data(), 1, Activations::kF32).ok());
  EXPECT_EQ(a, b);
  for (int t = 0; t < 3; ++t) {
    for (int r = 0; r < 8; ++r) {
      double want = 0;
      for (int c = 0; c < 32; ++c) want += static_cast<double>(w[r * 32 + c]) * x[t * 32 + c];
      EXPECT_NEAR(a[t * 8 + r], want, 1e-4);
    }
  }
}

}  // namespace
}  // namespace pagekv
