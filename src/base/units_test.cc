#include "pagekv/units.h"

#include <gtest/gtest.h>

namespace pagekv {
namespace {

TEST(ParseByteSizeTest, AcceptsPlainBytesAndUnits) {
  EXPECT_EQ(*ParseByteSize("1048576"), 1048576);
  EXPECT_EQ(*ParseByteSize("24GiB"), 24LL << 30);
  EXPECT_EQ(*ParseByteSize("512MiB"), 512LL << 20);
  EXPECT_EQ(*ParseByteSize("512mib"), 512LL << 20);
  EXPECT_EQ(*ParseByteSize("4 KiB"), 4096);
  EXPECT_EQ(*ParseByteSize("2G"), 2LL << 30);
  EXPECT_EQ(*ParseByteSize("3GB"), 3000000000LL);
  EXPECT_EQ(*ParseByteSize("1.5GiB"), 3LL << 29);
  EXPECT_EQ(*ParseByteSize("7B"), 7);
  EXPECT_EQ(*ParseByteSize("  64MiB  "), 64LL << 20);
}

TEST(ParseByteSizeTest, RejectsMalformedInputWithTheAcceptedForms) {
  for (const char* bad : {"", "abc", "-5", "-5GiB", "10XB", "1.2.3GiB", "1.5", "GiB",
                          "99999999999999999999", "9000000TiB"}) {
    Result<int64_t> r = ParseByteSize(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("GiB"), std::string::npos) << r.status().message();
  }
}

TEST(FormatBytesTest, PicksTheLargestUnitBelowTheValue) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1024), "1.00 KiB");
  EXPECT_EQ(FormatBytes(16374562816), "15.25 GiB");
}

}  // namespace
}  // namespace pagekv
