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

namespace pagekv {
namespace {

TEST(BlockPoolCachedTest, PlainBlocksGoFirstThenCachedOnesLeastRecentlyFreedFirst) {
  BlockPool pool(4);
  std::vector<BlockId> all;
  ASSERT_TRUE(pool.Allocate(4, all));
  std::vector<BlockId> evicted;
  pool.SetEvictionListener([&](BlockId b) {
    EXPECT_FALSE(pool.IsCached(b));  // the mark is cleared before the listener runs
    evicted.push_back(b);
  });
  // Blocks 0 and 2 hold published KV; freed in the order 2, 0, 1, 3.
  ASSERT_TRUE(pool.SetCached(all[0], true).ok());
  ASSERT_TRUE(pool.SetCached(all[2], true).ok());
  for (int i : {2, 0, 1, 3}) ASSERT_TRUE(pool.Release(all[static_cast<size_t>(i)]).ok());
  EXPECT_EQ(pool.num_free(), 4);
  EXPECT_EQ(pool.num_cached_free(), 2);
  EXPECT_EQ(pool.FreeListOrder(), (std::vector<BlockId>{all[1], all[3], all[2], all[0]}));
  pool.CheckInvariants();
  std::vector<BlockId> got;
  ASSERT_TRUE(pool.Allocate(3, got));
  EXPECT_EQ(got, (std::vector<BlockId>{all[1], all[3], all[2]}));
  EXPECT_EQ(evicted, (std::vector<BlockId>{all[2]}));
  EXPECT_TRUE(pool.IsCached(all[0]));
  pool.CheckInvariants();
}

TEST(BlockPoolCachedTest, ReclaimAndUnmarkWorkOnTheCachedList) {
  BlockPool pool(3);
  std::vector<BlockId> all;
  ASSERT_TRUE(pool.Allocate(3, all));
  for (BlockId b : all) ASSERT_TRUE(pool.SetCached(b, true).ok());
  for (BlockId b : all) ASSERT_TRUE(pool.Release(b).ok());
  ASSERT_TRUE(pool.Reclaim(all[1]).ok());  // a hit on a free cached block
  EXPECT_EQ(pool.RefCount(all[1]), 1);
  EXPECT_EQ(pool.num_cached_free(), 2);
  ASSERT_TRUE(pool.SetCached(all[0], false).ok());  // its key dropped: now plain, first to go
  EXPECT_EQ(pool.FreeListOrder(), (std::vector<BlockId>{all[0], all[2]}));
  pool.CheckInvariants();
  // A failed allocation evicts nothing.
  int evictions = 0;
  pool.SetEvictionListener([&](BlockId) { ++evictions; });
  std::vector<BlockId> none;
  EXPECT_FALSE(pool.Allocate(3, none));
  EXPECT_EQ(evictions, 0);
  EXPECT_EQ(pool.num_cached_free(), 1);
  EXPECT_EQ(pool.SetCached(BlockId{7}, true).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pagekv
