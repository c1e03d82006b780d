#include "kvcache/block_pool.h"

#include <set>

#include <gtest/gtest.h>

namespace pagekv {
namespace {

TEST(BlockPoolTest, AllocatesEveryBlockOnceThenRunsOut) {
  BlockPool pool(8);
  std::vector<BlockId> got;
  ASSERT_TRUE(pool.Allocate(8, got));
  std::set<int32_t> ids;
  for (BlockId b : got) ids.insert(ToInt(b));
  EXPECT_EQ(ids.size(), 8u);
  EXPECT_EQ(pool.num_free(), 0);
  EXPECT_FALSE(pool.CanAllocate(1));
  EXPECT_FALSE(pool.AllocateOne().has_value());
  pool.CheckInvariants();
}

TEST(BlockPoolTest, FailedAllocationChangesNothing) {
  BlockPool pool(4);
  std::vector<BlockId> out = {BlockId{99}};
  ASSERT_TRUE(pool.Allocate(1, out));
  const std::vector<BlockId> before_order = pool.FreeListOrder();
  const std::vector<BlockId> before_out = out;
  EXPECT_FALSE(pool.CanAllocate(4));
  EXPECT_FALSE(pool.Allocate(4, out));
  EXPECT_EQ(out, before_out);
  EXPECT_EQ(pool.FreeListOrder(), before_order);
  EXPECT_EQ(pool.num_free(), 3);
  pool.CheckInvariants();
}

TEST(BlockPoolTest, DoubleFreeIsRejectedAndChangesNothing) {
  BlockPool pool(4);
  const BlockId b = *pool.AllocateOne();
  ASSERT_TRUE(pool.Release(b).ok());
  const auto order = pool.FreeListOrder();
  Status s = pool.Release(b);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("double free"), std::string::npos);
  EXPECT_EQ(pool.FreeListOrder(), order);
  EXPECT_EQ(pool.num_free(), 4);
  pool.CheckInvariants();
}

TEST(BlockPoolTest, UnknownIdsAreRejected) {
  BlockPool pool(4);
  EXPECT_EQ(pool.Release(BlockId{4}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.Release(BlockId{-1}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.IncRef(BlockId{17}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.IncRef(BlockId{0}).code(), StatusCode::kFailedPrecondition);  // free block
  pool.CheckInvariants();
}

TEST(BlockPoolTest, SharedBlockIsFreedOnlyAtTheLastRelease) {
  BlockPool pool(2);
  const BlockId b = *pool.AllocateOne();
  ASSERT_TRUE(pool.IncRef(b).ok());
  EXPECT_EQ(pool.RefCount(b), 2);
  ASSERT_TRUE(pool.Release(b).ok());
  EXPECT_EQ(pool.num_free(), 1);
  ASSERT_TRUE(pool.Release(b).ok());
  EXPECT_EQ(pool.num_free(), 2);
  pool.CheckInvariants();
}

TEST(BlockPoolTest, FreeListIsOrderedByReleaseTimeForLru) {
  BlockPool pool(4);
  std::vector<BlockId> all;
  ASSERT_TRUE(pool.Allocate(4, all));
  for (int i : {2, 0, 3, 1}) ASSERT_TRUE(pool.Release(all[i]).ok());
  EXPECT_EQ(pool.FreeListOrder(), (std::vector<BlockId>{all[2], all[0], all[3], all[1]}));
  // The block freed longest ago is handed out first.
  EXPECT_EQ(*pool.AllocateOne(), all[2]);
  pool.CheckInvariants();
}

TEST(BlockPoolTest, ReclaimTakesASpecificFreeBlockFromTheMiddle) {
  BlockPool pool(5);
  ASSERT_TRUE(pool.Reclaim(BlockId{2}).ok());
  EXPECT_EQ(pool.RefCount(BlockId{2}), 1);
  EXPECT_EQ(pool.FreeListOrder(), (std::vector<BlockId>{BlockId{0}, BlockId{1}, BlockId{3}, BlockId{4}}));
  EXPECT_EQ(pool.Reclaim(BlockId{2}).code(), StatusCode::kFailedPrecondition);
  pool.CheckInvariants();
}

}  // namespace
}  // namespace pagekv
