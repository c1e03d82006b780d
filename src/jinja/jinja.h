// A Jinja2 subset for chat templates: the part of the language the chat
// templates of real models use, rendered the way Hugging Face's
// transformers renders them (trim_blocks and lstrip_blocks on, a trailing
// newline of the source dropped, Python's semantics for values, loop-local
// `set`, raise_exception, a tojson that is json.dumps(ensure_ascii=False)).
//
// Supported:
//   {{ expr }}  {% stmt %}  {# comment #}, with "-" / "+" whitespace control
//   statements: if / elif / else, for (tuple targets, `if` filter, else,
//     loop.index / index0 / revindex / revindex0 / first / last / length /
//     previtem / nextitem / cycle), break / continue, set (names, namespace
//     attributes, tuples, block set), macro (defaults, keyword arguments),
//     filter blocks, raw, generation (transformers' assistant markers)
//   expressions: literals (strings with Python escapes, ints, floats,
//     true / false / none in either case, lists, tuples, dicts), variables,
//     .attr and [key] (dict keys, list indexes, negative indexes, slices),
//     calls, filters, tests (is / is not), + - * / // % ** ~, comparisons,
//     in / not in, and / or / not, a if b else c
//   filters: abs, attr, capitalize, count, default (d), dictsort, first,
//     float, indent, int, items, join, last, length, list, lower, map,
//     max, min, reject, rejectattr, replace, reverse, round, safe, select,
//     selectattr, sort, string, sum, title, tojson, trim, unique, upper,
//     wordcount
//   tests: defined, undefined, none, boolean, true, false, integer, float,
//     number, string, mapping, iterable, sequence, callable, sameas,
//     equalto / eq / ==, ne, lt, le, gt, ge, in, even, odd, divisibleby,
//     lower, upper
//   methods: strings (strip, lstrip, rstrip, split, rsplit, startswith,
//     endswith, upper, lower, title, capitalize, replace, find, count,
//     join, splitlines), dicts (get, items, keys, values), lists (index,
//     count)
//   globals: raise_exception, namespace, range, dict, strftime_now
// Anything else (include, extends, import, block, call, an unknown filter,
// test or method) is an error naming the construct and its line.
//
// Thread safety: a parsed Template is immutable; Render may run
// concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "pagekv/status.h"

namespace pagekv::jinja {

class Value;
using List = std::vector<Value>;
// Insertion-ordered, string keys (as in the JSON chat templates receive).
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* Find(std::string_view key) const;
  void Set(const std::string& key, Value v);
};
using Function = std::function<Result<Value>(std::vector<Value> args, std::vector<std::pair<std::string, Value>> kwargs)>;

// A template value, with Python's semantics. Lists and dicts are shared:
// copies alias the same container (as Python references do).
class Value {
 public:
  enum class Kind : uint8_t { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kFunction };

  Value();  // undefined
  static Value None();
  Value(bool b);
  Value(int64_t i);
  Value(int i) : Value(static_cast<int64_t>(i)) {}
  Value(double f);
  Value(std::string s);
  Value(const char* s) : Value(std::string(s)) {}
  Value(List l);
  Value(Dict d);
  static Value Func(Function f);
  static Value Namespace(Dict d);  // a dict whose attributes `set ns.x = ...` may change
  // JSON: objects keep their key order; numbers stay int or float. Errors
  // (kInvalidArgument): nested deeper than kMaxDepth.
  static Result<Value> FromJson(const nlohmann::ordered_json& j);
  static constexpr uint32_t kMaxDepth = 256;

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_namespace() const { return kind_ == Kind::kDict && namespace_; }

  bool boolean() const { return b_; }
  int64_t integer() const { return i_; }
  double number() const { return kind_ == Kind::kInt ? static_cast<double>(i_) : f_; }
  const std::string& str() const { return *s_; }
  const List& list() const { return *l_; }
  List& mutable_list() const { return *l_; }
  const Dict& dict() const { return *d_; }
  Dict& mutable_dict() const { return *d_; }
  const Function& function() const { return *fn_; }

  bool Truthy() const;
  // Python's str() and repr().
  std::string Str() const;
  std::string Repr() const;
  // json.dumps(value, ensure_ascii=False, indent=indent) (indent < 0: none).
  Result<std::string> ToJson(int indent = -1) const;
  std::string TypeName() const;  // as Jinja names it in errors: "dict object", "str object", ...

  // Bounds the renderer checks every value against (a template, like a
  // model file, is not trusted): how deep lists and dicts nest (0 for a
  // scalar), an upper bound of Repr()'s bytes before escapes (a namespace
  // counts as a leaf: it prints as "<Namespace>"), and whether a namespace
  // is inside (a namespace may not hold one: no cycles, no stale bounds).
  // Computed once, when a list or dict is wrapped; its contents never change
  // afterwards (only a namespace's do, through `set ns.x`).
  uint32_t depth() const { return depth_; }
  uint64_t repr_bytes() const { return repr_bytes_; }
  bool holds_namespace() const { return holds_namespace_; }

 private:
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  bool namespace_ = false;
  bool holds_namespace_ = false;
  uint32_t depth_ = 0;
  uint64_t repr_bytes_ = 0;
  int64_t i_ = 0;
  double f_ = 0;
  std::shared_ptr<const std::string> s_;
  std::shared_ptr<List> l_;
  std::shared_ptr<Dict> d_;
  std::shared_ptr<Function> fn_;
};

bool Equal(const Value& a, const Value& b);

struct Options {
  bool trim_blocks = true;
  bool lstrip_blocks = true;
  bool keep_trailing_newline = false;
};

class Template {
 public:
  // Errors (kInvalidArgument): a syntax error or a construct outside the
  // subset, named, with its line.
  static Result<Template> Parse(std::string_view source, const Options& options = {});
  // `context` is a dict of variables. Errors (kInvalidArgument): a runtime
  // error (an undefined attribute of an undefined value, a type error, an
  // unknown filter) or raise_exception's message.
  Result<std::string> Render(const Value& context) const;

  struct Node;

 private:
  std::shared_ptr<const Node> root_;
};

}  // namespace pagekv::jinja
