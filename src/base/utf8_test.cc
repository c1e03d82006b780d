#include "base/utf8.h"

#include <string>

#include <gtest/gtest.h>

namespace pagekv {
namespace {

TEST(Utf8Test, AcceptsWellFormedText) {
  EXPECT_TRUE(IsValidUtf8(""));
  EXPECT_TRUE(IsValidUtf8("plain ascii"));
  EXPECT_TRUE(IsValidUtf8("caf\xc3\xa9"));                  // U+00E9
  EXPECT_TRUE(IsValidUtf8("\xe2\x82\xac"));                  // U+20AC
  EXPECT_TRUE(IsValidUtf8("\xf0\x9f\x98\x80"));              // U+1F600
  EXPECT_TRUE(IsValidUtf8("\xf4\x8f\xbf\xbf"));              // U+10FFFF, the last
  EXPECT_TRUE(IsValidUtf8(std::string("nul\0inside", 10)));  // U+0000 is text
}

TEST(Utf8Test, RejectsEveryMalformedKind) {
  EXPECT_FALSE(IsValidUtf8("\x80"));              // a stray continuation byte
  EXPECT_FALSE(IsValidUtf8("\xc3"));              // truncated
  EXPECT_FALSE(IsValidUtf8("\xe2\x82"));          // truncated
  EXPECT_FALSE(IsValidUtf8("\xc3\x28"));          // a continuation that is not one
  EXPECT_FALSE(IsValidUtf8("\xc0\xaf"));          // overlong '/'
  EXPECT_FALSE(IsValidUtf8("\xe0\x80\xaf"));      // overlong, 3 bytes
  EXPECT_FALSE(IsValidUtf8("\xed\xa0\x80"));      // U+D800, a surrogate
  EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));  // U+110000, past the end
  EXPECT_FALSE(IsValidUtf8("\xf8\x88\x80\x80\x80"));  // a 5-byte form
  EXPECT_FALSE(IsValidUtf8("ok then \xff"));
}

}  // namespace
}  // namespace pagekv
