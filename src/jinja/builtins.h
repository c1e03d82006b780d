// What the chat-template renderer (render.cc) calls beside its tree walk:
// Python's operators and string handling on Values (python_ops.cc), and
// the methods, tests and filters jinja.h lists (filters.cc). Errors name the
// template line. Not part of the module's interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "jinja/ast.h"

namespace pagekv::jinja::builtins {

using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;

// The rendered text's limit (and so the largest repetition).
constexpr size_t kMaxOutput = size_t{64} << 20;
// The largest value (Value::repr_bytes) and the most items a list made
// from a string or a range may hold: a template is untrusted, and a
// character costs 16 bytes as a view, about 100 as a list item.
constexpr size_t kMaxValueBytes = size_t{16} << 20;
constexpr size_t kMaxItems = size_t{1} << 20;

// An InvalidArgument error naming the template line.
Status Error(int line, const std::string& what);
// 's', for error messages.
std::string Quoted(const std::string& s);

// ---- strings as code points (UTF-8), Python's str semantics (python_ops.cc)
// Code points (a byte that starts no valid sequence counts as one), as views
// into s.
std::vector<std::string_view> Chars(std::string_view s);
// The bytes of the code point that starts at s[i] (i < s.size()).
size_t CharLen(std::string_view s, size_t i);
size_t CountChars(std::string_view s);
bool IsPySpace(std::string_view ch);
std::string Strip(const std::string& s, const Value* chars, bool left, bool right);
std::string AsciiMap(const std::string& s, int (*f)(int));
std::string Title(const std::string& s);
std::string Capitalize(const std::string& s);
// Errors: more than kMaxItems parts.
Result<std::vector<std::string>> Split(const std::string& s, const Value* sep, int64_t maxsplit, int line);

// ---- Python operators (python_ops.cc)
Result<Value> Arith(const std::string& op, const Value& a, const Value& b, int line);
Result<int> Order(const Value& a, const Value& b, int line);
Result<bool> Contains(const Value& container, const Value& item, int line);
Result<List> Iterate(const Value& v, int line);
Result<Value> Length(const Value& v, int line);
// A keyword argument by name, or the i-th positional one, else null.
const Value* Kwarg(const Kwargs& kw, std::string_view name);
const Value* Arg(const Args& a, size_t i, const Kwargs& kw, std::string_view name);
Result<Value> Slice(const Value& obj, const Value* start, const Value* stop, const Value* step, int line);

// ---- methods, attributes, items, tests, filters (filters.cc)
// Whether `name` is a method of obj's type that the renderer runs.
bool IsMethod(const Value& obj, const std::string& name);
// obj.name: a dict's entry, or a bound method; undefined otherwise.
Value Attribute(const Value& obj, const std::string& name);
// obj[key] (negative indexes from the end); undefined where Jinja's is.
Result<Value> Item(const Value& obj, const Value& key, int line);
// obj.name(a, kw): nullopt when obj has no such method.
std::optional<Result<Value>> Method(const Value& obj, const std::string& name, const Args& a, const Kwargs& kw, int line);
// Errors: a result past kMaxValueBytes.
Result<std::string> ReplaceAll(const std::string& s, const std::string& from, const std::string& to, int64_t count, int line);
// `v is name(a)`.
Result<bool> Test(const std::string& name, const Value& v, const Args& a, int line);
// `input | name(a, kw)`.
Result<Value> Filter(const std::string& name, Value input, const Args& a, const Kwargs& kw, int line);

}  // namespace pagekv::jinja::builtins
