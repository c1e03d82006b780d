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

TEST(Utf8Test, AppendsEachLengthsBoundariesAsRfc3629Spells) {
  struct Case {
    uint32_t cp;
    const char* bytes;
  };
  for (const Case c : {Case{0x41, "A"}, Case{0x7F, "\x7f"}, Case{0x80, "\xc2\x80"}, Case{0x7FF, "\xdf\xbf"},
                       Case{0x800, "\xe0\xa0\x80"}, Case{0x20AC, "\xe2\x82\xac"}, Case{0xFFFF, "\xef\xbf\xbf"},
                       Case{0x10000, "\xf0\x90\x80\x80"}, Case{0x1F600, "\xf0\x9f\x98\x80"},
                       Case{0x10FFFF, "\xf4\x8f\xbf\xbf"}}) {
    std::string out = "x";
    AppendUtf8(c.cp, out);
    EXPECT_EQ(out, std::string("x") + c.bytes) << std::hex << c.cp;
    EXPECT_TRUE(IsValidUtf8(out)) << std::hex << c.cp;
  }
  std::string nul;
  AppendUtf8(0, nul);
  EXPECT_EQ(nul, std::string(1, '\0'));
}

}  // namespace
}  // namespace pagekv
