#include "kernels/kv_arena.h"

#include <cstdint>

#include <gtest/gtest.h>

namespace pagekv {
namespace {

TEST(KvArenaTest, IsPageAlignedZeroedAndWritable) {
  auto arena = KvArena::Create({.size_bytes = 3 << 20, .huge_pages = true, .prefault = true});
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  KvArena& a = **arena;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 4096, 0u);
  EXPECT_EQ(a.size_bytes(), 3 << 20);
  for (int64_t i = 0; i < a.size_bytes(); i += 4093) EXPECT_EQ(a.data()[i], std::byte{0});
  a.data()[a.size_bytes() - 1] = std::byte{7};
  EXPECT_EQ(a.data()[a.size_bytes() - 1], std::byte{7});
}

TEST(KvArenaTest, RejectsNonPositiveSize) {
  EXPECT_EQ(KvArena::Create({.size_bytes = 0}).status().code(), StatusCode::kInvalidArgument);
}

TEST(KvArenaTest, ImpossibleSizeIsResourceExhaustedNotACrash) {
  auto arena = KvArena::Create({.size_bytes = int64_t{1} << 62, .huge_pages = false, .prefault = false});
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(arena.status().message().find("lower num_blocks"), std::string::npos);
}

}  // namespace
}  // namespace pagekv
