#include "pagekv/status.h"

#include <gtest/gtest.h>

namespace pagekv {
namespace {

Result<int> Half(int v) {
  if (v % 2 != 0) return InvalidArgumentError("odd: " + std::to_string(v));
  return v / 2;
}

Result<int> Quarter(int v) {
  PAGEKV_ASSIGN_OR_RETURN(int h, Half(v));
  PAGEKV_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

Status CheckPositive(int v) {
  if (v <= 0) return OutOfRangeError("not positive");
  return Status::Ok();
}

Status Both(int a, int b) {
  PAGEKV_RETURN_IF_ERROR(CheckPositive(a));
  PAGEKV_RETURN_IF_ERROR(CheckPositive(b));
  return Status::Ok();
}

TEST(StatusTest, OkStatusHasNoMessage) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.ToString(), "ok");
}

TEST(StatusTest, ErrorCarriesCodeAndMessage) {
  Status s = InvalidArgumentError("block_len = 100: must be a power of two");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.ToString(), "invalid argument: block_len = 100: must be a power of two");
}

TEST(StatusTest, ReturnIfErrorStopsAtFirstError) {
  EXPECT_TRUE(Both(1, 2).ok());
  EXPECT_EQ(Both(1, -2).code(), StatusCode::kOutOfRange);
}

TEST(ResultTest, AssignOrReturnPropagatesValueAndError) {
  Result<int> ok = Quarter(12);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 3);
  Result<int> bad = Quarter(6);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "odd: 3");
}

TEST(ResultTest, ConstructingFromOkStatusIsAnInternalError) {
  Result<int> r{Status::Ok()};
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace pagekv
