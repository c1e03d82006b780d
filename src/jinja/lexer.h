// The chat-template lexer (jinja.h's syntax): the source cut into text,
// tag delimiters (with whitespace control applied: "-" on a tag, trim_blocks,
// lstrip_blocks, the trailing newline) and the tokens inside the tags. Not
// part of the module's interface; the parser (jinja.cc) reads its tokens.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "jinja/ast.h"

namespace pagekv::jinja {

enum class Tok : uint8_t { kText, kBlockBegin, kVarBegin, kBlockEnd, kVarEnd, kName, kString, kInt, kFloat, kOp, kEnd };

struct Token {
  Tok type;
  std::string text;  // text, name, string value, operator, number spelling
  int line;
};

// The tokens of `source`, ending with kEnd. Errors (SyntaxError, naming the
// line): an unclosed tag, comment or string, a bad escape, a character no
// token starts with.
Result<std::vector<Token>> Lex(std::string_view source, const Options& options);

}  // namespace pagekv::jinja
