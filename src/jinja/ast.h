// The parsed form of a template (internal to the jinja module): expression
// and statement trees, built by the parser (jinja.cc), walked by the
// renderer (render.cc).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "jinja/jinja.h"

namespace pagekv::jinja {

struct Expr;
using ExprPtr = std::shared_ptr<const Expr>;

struct Expr {
  enum class K : uint8_t {
    kLiteral, kName, kAttr, kItem, kSlice, kCall, kFilter, kTest, kNeg, kPos, kNot, kBinary, kCompare, kAnd, kOr,
    kCond, kList, kTuple, kDict,
  };
  K k;
  int line = 0;
  uint32_t depth = 1;  // of the tree below (the parser's Make sets it)
  Value literal;
  std::string name;  // kName, kAttr, kFilter, kTest; kBinary: the operator
  std::vector<ExprPtr> args;  // operands / arguments / items (dict: key, value pairs)
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;  // kCompare
  bool negated = false;  // kTest: "is not"
  bool has_input = false;  // kFilter: args[0] is the filtered value (not in a filter block)
  bool has_slice[3] = {false, false, false};
};

struct Template::Node {
  enum class K : uint8_t { kBody, kText, kOutput, kIf, kFor, kSet, kSetAttr, kSetBlock, kMacro, kFilterBlock, kBreak, kContinue };
  K k;
  int line = 0;
  std::string text;  // kText; kSet / kSetBlock / kMacro: the name; kSetAttr: the attribute
  std::vector<std::string> targets;  // kFor / kSet: names (more than one: unpacked)
  ExprPtr expr;  // kOutput, kFor (iterable), kSet, kSetAttr (value)
  ExprPtr expr2;  // kFor: the `if` filter; kSetAttr: the object; kFilterBlock: the filter (its input unset)
  std::vector<std::pair<ExprPtr, std::shared_ptr<Node>>> branches;  // kIf
  std::vector<std::shared_ptr<Node>> children;  // kBody
  std::shared_ptr<Node> body, else_body;
  std::vector<std::pair<std::string, ExprPtr>> params;  // kMacro (default or null)
};


Status SyntaxError(int line, const std::string& what);

}  // namespace pagekv::jinja
