// Python's operators and str semantics on Values, for the chat-template
// renderer (builtins.h).
#include <algorithm>
#include <climits>
#include <cmath>

#include "jinja/builtins.h"

namespace pagekv::jinja::builtins {

Status Error(int line, const std::string& what) {
  return InvalidArgumentError("chat template line " + std::to_string(line) + ": " + what);
}

std::string Quoted(const std::string& s) {
  // Built by appends: GCC 12 warns falsely (-Wrestrict) on "'" + s + "'"
  // once inlined here.
  std::string q;
  q.reserve(s.size() + 2);
  q += '\'';
  q += s;
  q += '\'';
  return q;
}

// ---- strings as code points

size_t CharLen(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  return i + n > s.size() ? 1 : n;
}

std::vector<std::string_view> Chars(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t i = 0; i < s.size();) {
    const size_t n = CharLen(s, i);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

size_t CountChars(std::string_view s) {
  size_t count = 0;
  for (size_t i = 0; i < s.size(); i += CharLen(s, i)) ++count;
  return count;
}

bool IsPySpace(std::string_view ch) {
  static const char* kUnicode[] = {"\xc2\x85", "\xc2\xa0", "\xe1\x9a\x80", "\xe2\x80\xa8", "\xe2\x80\xa9", "\xe2\x80\xaf",
                                   "\xe2\x81\x9f", "\xe3\x80\x80"};
  if (ch.size() == 1) {
    const char c = ch[0];
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f' || (c >= 0x1c && c <= 0x1f);
  }
  if (ch.size() == 3 && ch[0] == '\xe2' && ch[1] == '\x80' && static_cast<unsigned char>(ch[2]) >= 0x80 &&
      static_cast<unsigned char>(ch[2]) <= 0x8a) {
    return true;  // U+2000..U+200A
  }
  for (const char* u : kUnicode) {
    if (ch == u) return true;
  }
  return false;
}

// Python's str.strip / lstrip / rstrip (chars: null = whitespace).
std::string Strip(const std::string& s, const Value* chars, bool left, bool right) {
  const std::vector<std::string_view> cs = Chars(s);
  std::vector<std::string_view> set;
  if (chars != nullptr && chars->is_string()) {
    set = Chars(chars->str());
    std::sort(set.begin(), set.end());
  }
  auto strip = [&](std::string_view c) {
    return chars != nullptr && chars->is_string() ? std::binary_search(set.begin(), set.end(), c) : IsPySpace(c);
  };
  size_t b = 0, e = cs.size();
  if (left) {
    while (b < e && strip(cs[b])) ++b;
  }
  if (right) {
    while (e > b && strip(cs[e - 1])) --e;
  }
  std::string out;
  for (size_t i = b; i < e; ++i) out += cs[i];
  return out;
}

std::string AsciiMap(const std::string& s, int (*f)(int)) {
  std::string out = s;
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x80) c = static_cast<char>(f(static_cast<unsigned char>(c)));
  }
  return out;
}

std::string Title(const std::string& s) {
  std::string out = s;
  bool prev_cased = false;
  for (char& c : out) {
    const auto u = static_cast<unsigned char>(c);
    const bool cased = u < 0x80 && std::isalpha(u);
    if (cased) c = static_cast<char>(prev_cased ? std::tolower(u) : std::toupper(u));
    prev_cased = cased;
  }
  return out;
}

std::string Capitalize(const std::string& s) {
  std::string out = AsciiMap(s, [](int c) { return std::tolower(c); });
  if (!out.empty() && static_cast<unsigned char>(out[0]) < 0x80) out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
  return out;
}

Result<std::vector<std::string>> Split(const std::string& s, const Value* sep, int64_t maxsplit, int line) {
  std::vector<std::string> out;
  auto too_many = [&] { return Error(line, "split() into more than " + std::to_string(kMaxItems) + " parts"); };
  if (sep == nullptr || sep->is_none()) {  // runs of whitespace; no empty strings
    const std::vector<std::string_view> cs = Chars(s);
    size_t i = 0;
    while (i < cs.size()) {
      while (i < cs.size() && IsPySpace(cs[i])) ++i;
      if (i >= cs.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        std::string rest;
        for (size_t k = i; k < cs.size(); ++k) rest += cs[k];
        out.push_back(Strip(rest, nullptr, false, true));
        return out;
      }
      std::string word;
      while (i < cs.size() && !IsPySpace(cs[i])) word += cs[i++];
      if (out.size() >= kMaxItems) return too_many();
      out.push_back(word);
    }
    return out;
  }
  const std::string& d = sep->str();
  size_t at = 0;
  while (true) {
    const size_t f = (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) ? std::string::npos : s.find(d, at);
    if (out.size() >= kMaxItems) return too_many();
    if (f == std::string::npos) {
      out.push_back(s.substr(at));
      return out;
    }
    out.push_back(s.substr(at, f - at));
    at = f + d.size();
  }
}

// ---- Python operators

Result<Value> Arith(const std::string& op, const Value& a, const Value& b, int line) {
  auto num = [](const Value& v) { return v.is_number() || v.kind() == Value::Kind::kBool; };
  auto as_int = [](const Value& v) { return v.kind() == Value::Kind::kBool ? (v.boolean() ? 1 : 0) : v.integer(); };
  auto as_float = [](const Value& v) { return v.kind() == Value::Kind::kBool ? (v.boolean() ? 1.0 : 0.0) : v.number(); };
  const bool ints = num(a) && num(b) && a.kind() != Value::Kind::kFloat && b.kind() != Value::Kind::kFloat;
  auto type_error = [&]() {
    return Error(line, "unsupported operand types for " + op + ": '" + a.TypeName() + "' and '" + b.TypeName() + "'");
  };
  if (op == "+") {
    if (a.is_string() && b.is_string()) {
      if (a.str().size() + b.str().size() > kMaxValueBytes) return Error(line, "a string larger than 16 MiB");
      return Value(a.str() + b.str());
    }
    if (a.is_list() && b.is_list()) {
      if (a.list().size() + b.list().size() > kMaxItems) {
        return Error(line, "a list of more than " + std::to_string(kMaxItems) + " items");
      }
      List l = a.list();
      l.insert(l.end(), b.list().begin(), b.list().end());
      return Value(std::move(l));
    }
  }
  if (op == "*") {
    const Value* seq = a.is_string() || a.is_list() ? &a : b.is_string() || b.is_list() ? &b : nullptr;
    const Value* n = seq == &a ? &b : &a;
    if (seq != nullptr && (n->kind() == Value::Kind::kInt || n->kind() == Value::Kind::kBool)) {
      const int64_t times = std::max<int64_t>(0, as_int(*n));
      const size_t unit = seq->is_string() ? seq->str().size() : seq->list().size();
      const size_t limit = seq->is_string() ? kMaxValueBytes : kMaxItems;
      if (unit > 0 && static_cast<uint64_t>(times) > limit / unit) return Error(line, "a repetition too large");
      if (seq->is_string()) {
        std::string out;
        for (int64_t i = 0; i < times; ++i) out += seq->str();
        return Value(std::move(out));
      }
      List l;
      for (int64_t i = 0; i < times; ++i) l.insert(l.end(), seq->list().begin(), seq->list().end());
      return Value(std::move(l));
    }
  }
  if (!num(a) || !num(b)) return type_error();
  if (ints) {
    const int64_t x = as_int(a), y = as_int(b);
    int64_t r;
    if (op == "+" && !__builtin_add_overflow(x, y, &r)) return Value(r);
    if (op == "-" && !__builtin_sub_overflow(x, y, &r)) return Value(r);
    if (op == "*" && !__builtin_mul_overflow(x, y, &r)) return Value(r);
    if (op == "//" || op == "%") {
      if (y == 0) return Error(line, "integer division or modulo by zero");
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) {
        --q;
        m += y;
      }
      return op == "//" ? Value(q) : Value(m);
    }
    if (op == "**" && y >= 0) {
      int64_t p = 1;
      bool overflow = false;
      for (int64_t i = 0; i < y && !overflow; ++i) overflow = __builtin_mul_overflow(p, x, &p);
      if (!overflow) return Value(p);
    }
  }
  const double x = as_float(a), y = as_float(b);
  if (op == "+") return Value(x + y);
  if (op == "-") return Value(x - y);
  if (op == "*") return Value(x * y);
  if (op == "/") {
    if (y == 0) return Error(line, "division by zero");
    return Value(x / y);
  }
  if (op == "//" || op == "%") {
    if (y == 0) return Error(line, "float division or modulo by zero");
    const double m = std::fmod(x, y);
    const double mod = (m != 0 && ((m < 0) != (y < 0))) ? m + y : m;
    return op == "//" ? Value(std::floor((x - mod) / y + 0.5)) : Value(mod);
  }
  if (op == "**") return Value(std::pow(x, y));
  return type_error();
}

Result<int> Order(const Value& a, const Value& b, int line) {
  auto num = [](const Value& v) { return v.is_number() || v.kind() == Value::Kind::kBool; };
  if (num(a) && num(b)) {
    const double x = a.kind() == Value::Kind::kBool ? a.boolean() : a.number();
    const double y = b.kind() == Value::Kind::kBool ? b.boolean() : b.number();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str() ? -1 : a.str() > b.str() ? 1 : 0;
  if (a.is_list() && b.is_list()) {
    for (size_t i = 0; i < std::min(a.list().size(), b.list().size()); ++i) {
      if (Equal(a.list()[i], b.list()[i])) continue;
      return Order(a.list()[i], b.list()[i], line);
    }
    return a.list().size() < b.list().size() ? -1 : a.list().size() > b.list().size() ? 1 : 0;
  }
  return Error(line, "'<' is not supported between '" + a.TypeName() + "' and '" + b.TypeName() + "'");
}

Result<bool> Contains(const Value& container, const Value& item, int line) {
  if (container.is_string()) {
    if (!item.is_string()) return Error(line, "'in <string>' needs a string on the left, not " + item.TypeName());
    return container.str().find(item.str()) != std::string::npos;
  }
  if (container.is_list()) {
    for (const Value& v : container.list()) {
      if (Equal(v, item)) return true;
    }
    return false;
  }
  if (container.is_dict()) return item.is_string() && container.dict().Find(item.str()) != nullptr;
  if (container.is_undefined()) return false;
  return Error(line, "argument of type '" + container.TypeName() + "' is not iterable");
}

// The items a for loop or a filter walks: list items, dict keys, a
// string's characters; nothing for undefined.
Result<List> Iterate(const Value& v, int line) {
  switch (v.kind()) {
    case Value::Kind::kList: return v.list();
    case Value::Kind::kDict: {
      List keys;
      for (const auto& [k, x] : v.dict().items) keys.emplace_back(k);
      return keys;
    }
    case Value::Kind::kString: {
      if (CountChars(v.str()) > kMaxItems) {
        return Error(line, "iterating over a string of more than " + std::to_string(kMaxItems) + " characters");
      }
      List out;
      for (std::string_view c : Chars(v.str())) out.emplace_back(std::string(c));
      return out;
    }
    case Value::Kind::kUndefined: return List{};
    default: return Error(line, Quoted(v.TypeName()) + " is not iterable");
  }
}

Result<Value> Length(const Value& v, int line) {
  switch (v.kind()) {
    case Value::Kind::kString: return Value(static_cast<int64_t>(CountChars(v.str())));
    case Value::Kind::kList: return Value(static_cast<int64_t>(v.list().size()));
    case Value::Kind::kDict: return Value(static_cast<int64_t>(v.dict().items.size()));
    case Value::Kind::kUndefined: return Value(int64_t{0});
    default: return Error(line, "object of type '" + v.TypeName() + "' has no len()");
  }
}

const Value* Kwarg(const Kwargs& kw, std::string_view name) {
  for (const auto& [k, v] : kw) {
    if (k == name) return &v;
  }
  return nullptr;
}

// Positional argument i, else keyword `name`, else null.
const Value* Arg(const Args& a, size_t i, const Kwargs& kw, std::string_view name) {
  if (i < a.size()) return &a[i];
  return Kwarg(kw, name);
}

Result<Value> Slice(const Value& obj, const Value* start, const Value* stop, const Value* step, int line) {
  int64_t n;
  std::vector<std::string_view> chars;
  if (obj.is_string()) {
    chars = Chars(obj.str());
    n = static_cast<int64_t>(chars.size());
  } else if (obj.is_list()) {
    n = static_cast<int64_t>(obj.list().size());
  } else {
    return Error(line, Quoted(obj.TypeName()) + " cannot be sliced");
  }
  auto get = [&](const Value* v, int64_t def) -> Result<int64_t> {
    if (v == nullptr || v->is_none()) return def;
    if (v->kind() != Value::Kind::kInt) return Error(line, "slice indices must be integers");
    return v->integer();
  };
  PAGEKV_ASSIGN_OR_RETURN(const int64_t st, get(step, 1));
  if (st == 0) return Error(line, "slice step cannot be zero");
  PAGEKV_ASSIGN_OR_RETURN(int64_t b, get(start, st > 0 ? 0 : n - 1));
  PAGEKV_ASSIGN_OR_RETURN(int64_t e, get(stop, st > 0 ? n : -1));  // -1: before the first item
  // Python's normalization: negative indexes count from the end, then
  // clamp to the range a step of that sign can walk.
  auto clamp = [&](int64_t i) {
    if (i < 0) i += n;
    return st > 0 ? std::clamp<int64_t>(i, 0, n) : std::clamp<int64_t>(i, -1, n - 1);
  };
  if (start != nullptr && !start->is_none()) b = clamp(b);
  if (stop != nullptr && !stop->is_none()) e = clamp(e);
  std::string s;
  List l;
  for (int64_t i = b; st > 0 ? i < e : i > e; i += st) {
    if (obj.is_string()) {
      s += chars[static_cast<size_t>(i)];
    } else {
      l.push_back(obj.list()[static_cast<size_t>(i)]);
    }
  }
  if (obj.is_string()) return Value(std::move(s));
  return Value(std::move(l));
}

}  // namespace pagekv::jinja::builtins
