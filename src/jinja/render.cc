// jinja::Template::Render (jinja.h): a tree-walking evaluator with Python's
// value semantics, Jinja's scoping (loop bodies and macros have their own
// scope; if does not) and the filters, tests, methods and globals jinja.h
// lists.
#include <algorithm>
#include <climits>
#include <cmath>
#include <ctime>
#include <unordered_map>

#include "jinja/ast.h"

namespace pagekv::jinja {
namespace {

using Node = Template::Node;
using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;

constexpr size_t kMaxOutput = size_t{64} << 20;
constexpr int kMaxDepth = 200;

Status Error(int line, const std::string& what) {
  return InvalidArgumentError("chat template line " + std::to_string(line) + ": " + what);
}

// ---- strings as code points

std::vector<std::string> Chars(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (i + n > s.size()) n = 1;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

bool IsPySpace(const std::string& ch) {
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
  const std::vector<std::string> cs = Chars(s);
  std::vector<std::string> set;
  if (chars != nullptr && chars->is_string()) set = Chars(chars->str());
  auto strip = [&](const std::string& c) {
    return chars != nullptr && chars->is_string() ? std::find(set.begin(), set.end(), c) != set.end() : IsPySpace(c);
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

std::vector<std::string> Split(const std::string& s, const Value* sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep == nullptr || sep->is_none()) {  // runs of whitespace; no empty strings
    const std::vector<std::string> cs = Chars(s);
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
      out.push_back(word);
    }
    return out;
  }
  const std::string& d = sep->str();
  size_t at = 0;
  while (true) {
    const size_t f = (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) ? std::string::npos : s.find(d, at);
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
    if (a.is_string() && b.is_string()) return Value(a.str() + b.str());
    if (a.is_list() && b.is_list()) {
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
      if (unit > 0 && static_cast<uint64_t>(times) > kMaxOutput / unit) return Error(line, "a repetition too large");
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
      List out;
      for (std::string& c : Chars(v.str())) out.emplace_back(std::move(c));
      return out;
    }
    case Value::Kind::kUndefined: return List{};
    default: return Error(line, "'" + v.TypeName() + "' is not iterable");
  }
}

Result<Value> Length(const Value& v, int line) {
  switch (v.kind()) {
    case Value::Kind::kString: return Value(static_cast<int64_t>(Chars(v.str()).size()));
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
  std::vector<std::string> chars;
  if (obj.is_string()) {
    chars = Chars(obj.str());
    n = static_cast<int64_t>(chars.size());
  } else if (obj.is_list()) {
    n = static_cast<int64_t>(obj.list().size());
  } else {
    return Error(line, "'" + obj.TypeName() + "' cannot be sliced");
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

class Renderer {
 public:
  explicit Renderer(const Value& context) : context_(context) { frames_.emplace_back(); }

  Status Run(const Node& root, std::string& out) {
    Flow flow = Flow::kNormal;
    return Exec(root, out, flow);
  }

 private:
  enum class Flow { kNormal, kBreak, kContinue };
  using Frame = std::unordered_map<std::string, Value>;

  Value Lookup(const std::string& name) const {
    for (auto f = frames_.rbegin(); f != frames_.rend(); ++f) {
      if (auto it = f->find(name); it != f->end()) return it->second;
    }
    if (context_.is_dict()) {
      if (const Value* v = context_.dict().Find(name)) return *v;
    }
    return Global(name);
  }

  Value Global(const std::string& name) const {
    if (name == "raise_exception") {
      return Value::Func([](Args a, Kwargs) -> Result<Value> {
        return InvalidArgumentError(a.empty() ? "the chat template raised an exception" : a[0].Str());
      });
    }
    if (name == "namespace") {
      return Value::Func([](Args a, Kwargs kw) -> Result<Value> {
        Dict d;
        if (!a.empty() && a[0].is_dict()) d = a[0].dict();
        for (auto& [k, v] : kw) d.Set(k, v);
        return Value::Namespace(std::move(d));
      });
    }
    if (name == "dict") {
      return Value::Func([](Args a, Kwargs kw) -> Result<Value> {
        Dict d;
        if (!a.empty() && a[0].is_dict()) d = a[0].dict();
        for (auto& [k, v] : kw) d.Set(k, v);
        return Value(std::move(d));
      });
    }
    if (name == "range") {
      return Value::Func([](Args a, Kwargs) -> Result<Value> {
        for (const Value& v : a) {
          if (v.kind() != Value::Kind::kInt) return InvalidArgumentError("chat template: range() takes integers");
        }
        if (a.empty() || a.size() > 3) return InvalidArgumentError("chat template: range() takes 1 to 3 arguments");
        const int64_t start = a.size() == 1 ? 0 : a[0].integer(), stop = a.size() == 1 ? a[0].integer() : a[1].integer();
        const int64_t step = a.size() == 3 ? a[2].integer() : 1;
        if (step == 0) return InvalidArgumentError("chat template: range() step must not be zero");
        List l;
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
          if (l.size() >= (1u << 20)) return InvalidArgumentError("chat template: range() of more than 1048576 items");
          l.emplace_back(i);
        }
        return Value(std::move(l));
      });
    }
    if (name == "strftime_now") {
      return Value::Func([](Args a, Kwargs) -> Result<Value> {
        const std::time_t now = std::time(nullptr);
        std::tm tm{};
        localtime_r(&now, &tm);
        char buf[256];
        const size_t n = std::strftime(buf, sizeof buf, a.empty() ? "%Y-%m-%d" : a[0].Str().c_str(), &tm);
        return Value(std::string(buf, n));
      });
    }
    return Value();
  }

  void Set(const std::string& name, Value v) { frames_.back()[name] = std::move(v); }

  Status Append(std::string& out, const std::string& s, int line) {
    if (out.size() + s.size() > kMaxOutput) return Error(line, "the rendered text exceeds 64 MiB");
    out += s;
    return Status::Ok();
  }

  Status Exec(const Node& n, std::string& out, Flow& flow) {
    switch (n.k) {
      case Node::K::kBody:
        for (const auto& c : n.children) {
          PAGEKV_RETURN_IF_ERROR(Exec(*c, out, flow));
          if (flow != Flow::kNormal) return Status::Ok();
        }
        return Status::Ok();
      case Node::K::kText: return Append(out, n.text, n.line);
      case Node::K::kOutput: {
        PAGEKV_ASSIGN_OR_RETURN(Value v, Eval(*n.expr));
        return Append(out, v.is_undefined() ? std::string() : v.Str(), n.line);
      }
      case Node::K::kIf:
        for (const auto& [cond, body] : n.branches) {
          PAGEKV_ASSIGN_OR_RETURN(Value c, Eval(*cond));
          if (c.Truthy()) return Exec(*body, out, flow);
        }
        if (n.else_body) return Exec(*n.else_body, out, flow);
        return Status::Ok();
      case Node::K::kFor: return For(n, out, flow);
      case Node::K::kSet: {
        PAGEKV_ASSIGN_OR_RETURN(Value v, Eval(*n.expr));
        if (n.targets.size() == 1) {
          Set(n.targets[0], std::move(v));
          return Status::Ok();
        }
        return Unpack(n.targets, v, n.line);
      }
      case Node::K::kSetAttr: {
        const Value obj = Lookup(n.expr2->name);
        if (!obj.is_namespace()) {
          return Error(n.line, "cannot set '" + n.text + "' on '" + n.expr2->name + "': only a namespace() takes attributes");
        }
        PAGEKV_ASSIGN_OR_RETURN(Value v, Eval(*n.expr));
        obj.mutable_dict().Set(n.text, std::move(v));
        return Status::Ok();
      }
      case Node::K::kSetBlock: {
        std::string body;
        Flow f = Flow::kNormal;
        PAGEKV_RETURN_IF_ERROR(Exec(*n.body, body, f));
        Set(n.text, Value(std::move(body)));
        return Status::Ok();
      }
      case Node::K::kMacro: {
        const Node* macro = &n;
        Set(n.text, Value::Func([this, macro](Args a, Kwargs kw) -> Result<Value> { return CallMacro(*macro, a, kw); }));
        return Status::Ok();
      }
      case Node::K::kFilterBlock: {
        std::string body;
        Flow f = Flow::kNormal;
        PAGEKV_RETURN_IF_ERROR(Exec(*n.body, body, f));
        PAGEKV_ASSIGN_OR_RETURN(Value v, ApplyFilter(*n.expr2, Value(std::move(body))));
        return Append(out, v.Str(), n.line);
      }
      case Node::K::kBreak:
      case Node::K::kContinue:
        if (loops_ == 0) return Error(n.line, "break / continue outside a for loop");
        flow = n.k == Node::K::kBreak ? Flow::kBreak : Flow::kContinue;
        return Status::Ok();
    }
    return Status::Ok();
  }

  Status Unpack(const std::vector<std::string>& targets, const Value& v, int line) {
    if (!v.is_list() || v.list().size() != targets.size()) {
      return Error(line, "cannot unpack " + v.TypeName() + " into " + std::to_string(targets.size()) + " names");
    }
    for (size_t i = 0; i < targets.size(); ++i) Set(targets[i], v.list()[i]);
    return Status::Ok();
  }

  Status For(const Node& n, std::string& out, Flow& flow) {
    PAGEKV_ASSIGN_OR_RETURN(Value iterable, Eval(*n.expr));
    if (iterable.is_none()) return Error(n.line, "'NoneType' object is not iterable");
    PAGEKV_ASSIGN_OR_RETURN(List items, Iterate(iterable, n.line));
    if (n.expr2) {  // `for x in xs if cond`: filtered before the loop counts
      List kept;
      for (const Value& item : items) {
        frames_.emplace_back();
        Status s = n.targets.size() == 1 ? (Set(n.targets[0], item), Status::Ok()) : Unpack(n.targets, item, n.line);
        Result<Value> c = s.ok() ? Eval(*n.expr2) : Result<Value>(s);
        frames_.pop_back();
        if (!c.ok()) return c.status();
        if (c->Truthy()) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      if (n.else_body) return Exec(*n.else_body, out, flow);
      return Status::Ok();
    }
    ++loops_;
    const auto len = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < len; ++i) {
      frames_.emplace_back();
      Dict loop;
      loop.Set("index", Value(i + 1));
      loop.Set("index0", Value(i));
      loop.Set("revindex", Value(len - i));
      loop.Set("revindex0", Value(len - i - 1));
      loop.Set("first", Value(i == 0));
      loop.Set("last", Value(i == len - 1));
      loop.Set("length", Value(len));
      loop.Set("depth", Value(int64_t{1}));
      loop.Set("depth0", Value(int64_t{0}));
      loop.Set("previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : Value());
      loop.Set("nextitem", i + 1 < len ? items[static_cast<size_t>(i + 1)] : Value());
      loop.Set("cycle", Value::Func([i](Args a, Kwargs) -> Result<Value> {
                 if (a.empty()) return InvalidArgumentError("chat template: loop.cycle() needs at least one value");
                 return a[static_cast<size_t>(i) % a.size()];
               }));
      Set("loop", Value(std::move(loop)));
      Status s = n.targets.size() == 1 ? (Set(n.targets[0], items[static_cast<size_t>(i)]), Status::Ok())
                                       : Unpack(n.targets, items[static_cast<size_t>(i)], n.line);
      Flow f = Flow::kNormal;
      if (s.ok()) s = Exec(*n.body, out, f);
      frames_.pop_back();
      if (!s.ok()) {
        --loops_;
        return s;
      }
      if (f == Flow::kBreak) break;
    }
    --loops_;
    return Status::Ok();
  }

  Result<Value> CallMacro(const Node& m, const Args& a, const Kwargs& kw) {
    if (++depth_ > kMaxDepth) {
      --depth_;
      return Error(m.line, "macros nested deeper than " + std::to_string(kMaxDepth) + " calls");
    }
    if (a.size() > m.params.size()) {
      --depth_;
      return Error(m.line, "macro '" + m.text + "' takes " + std::to_string(m.params.size()) + " arguments");
    }
    // A macro sees the template's top level and its own arguments, not the caller's locals.
    std::vector<Frame> saved(frames_.begin() + 1, frames_.end());
    frames_.resize(1);
    frames_.emplace_back();
    Status s = Status::Ok();
    for (size_t i = 0; i < m.params.size() && s.ok(); ++i) {
      const auto& [name, def] = m.params[i];
      if (i < a.size()) {
        Set(name, a[i]);
      } else if (const Value* v = Kwarg(kw, name)) {
        Set(name, *v);
      } else if (def) {
        Result<Value> d = Eval(*def);
        if (d.ok()) {
          Set(name, *d);
        } else {
          s = d.status();
        }
      } else {
        Set(name, Value());
      }
    }
    std::string out;
    Flow f = Flow::kNormal;
    if (s.ok()) s = Exec(*m.body, out, f);
    frames_.resize(1);
    frames_.insert(frames_.end(), saved.begin(), saved.end());
    --depth_;
    if (!s.ok()) return s;
    return Value(std::move(out));
  }

  static std::string Describe(const Expr& e) {
    switch (e.k) {
      case Expr::K::kName: return e.name;
      case Expr::K::kAttr: return Describe(*e.args[0]) + "." + e.name;
      case Expr::K::kItem: return Describe(*e.args[0]) + "[...]";
      default: return "a value";
    }
  }

  Result<Value> Eval(const Expr& e) {
    switch (e.k) {
      case Expr::K::kLiteral: return e.literal;
      case Expr::K::kName: return Lookup(e.name);
      case Expr::K::kAttr: {
        PAGEKV_ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0]));
        if (obj.is_undefined()) return Error(e.line, "'" + Describe(*e.args[0]) + "' is undefined (reading ." + e.name + ")");
        return Attribute(obj, e.name);
      }
      case Expr::K::kItem: {
        PAGEKV_ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0]));
        PAGEKV_ASSIGN_OR_RETURN(Value key, Eval(*e.args[1]));
        if (obj.is_undefined()) return Error(e.line, "'" + Describe(*e.args[0]) + "' is undefined (indexing it)");
        return Item(obj, key, e.line);
      }
      case Expr::K::kSlice: {
        PAGEKV_ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0]));
        Value parts[3];
        for (int p = 0; p < 3; ++p) {
          if (e.has_slice[p]) {
            PAGEKV_ASSIGN_OR_RETURN(parts[p], Eval(*e.args[static_cast<size_t>(p) + 1]));
          }
        }
        return Slice(obj, e.has_slice[0] ? &parts[0] : nullptr, e.has_slice[1] ? &parts[1] : nullptr,
                     e.has_slice[2] ? &parts[2] : nullptr, e.line);
      }
      case Expr::K::kCall: {
        Args a;
        Kwargs kw;
        for (size_t i = 1; i < e.args.size(); ++i) {
          PAGEKV_ASSIGN_OR_RETURN(Value v, Eval(*e.args[i]));
          a.push_back(std::move(v));
        }
        for (const auto& [k, x] : e.kwargs) {
          PAGEKV_ASSIGN_OR_RETURN(Value v, Eval(*x));
          kw.emplace_back(k, std::move(v));
        }
        const Expr& callee = *e.args[0];
        if (callee.k == Expr::K::kAttr) {  // a method call
          PAGEKV_ASSIGN_OR_RETURN(Value obj, Eval(*callee.args[0]));
          if (obj.is_undefined()) return Error(e.line, "'" + Describe(*callee.args[0]) + "' is undefined (calling ." + callee.name + "())");
          if (!obj.is_namespace() && (obj.is_string() || obj.is_list() || obj.is_dict())) {
            if (std::optional<Result<Value>> r = Method(obj, callee.name, a, kw, e.line)) return std::move(*r);
          }
        }
        PAGEKV_ASSIGN_OR_RETURN(Value f, Eval(callee));
        if (f.kind() != Value::Kind::kFunction) {
          return Error(e.line, "'" + Describe(callee) + "' is " + (f.is_undefined() ? "undefined" : "not callable (" + f.TypeName() + ")"));
        }
        Result<Value> r = f.function()(std::move(a), std::move(kw));
        if (!r.ok() && r.status().message().rfind("chat template", 0) != 0) {
          return InvalidArgumentError("chat template line " + std::to_string(e.line) + ": " + r.status().message());
        }
        return r;
      }
      case Expr::K::kFilter: {
        PAGEKV_ASSIGN_OR_RETURN(Value input, Eval(*e.args[0]));
        return ApplyFilter(e, std::move(input));
      }
      case Expr::K::kTest: {
        PAGEKV_ASSIGN_OR_RETURN(Value v, Eval(*e.args[0]));
        Args a;
        for (size_t i = 1; i < e.args.size(); ++i) {
          PAGEKV_ASSIGN_OR_RETURN(Value x, Eval(*e.args[i]));
          a.push_back(std::move(x));
        }
        PAGEKV_ASSIGN_OR_RETURN(bool r, Test(e.name, v, a, e.line));
        return Value(r != e.negated);
      }
      case Expr::K::kNeg:
      case Expr::K::kPos: {
        PAGEKV_ASSIGN_OR_RETURN(Value v, Eval(*e.args[0]));
        if (v.kind() == Value::Kind::kInt) return e.k == Expr::K::kNeg ? Value(-v.integer()) : v;
        if (v.kind() == Value::Kind::kFloat) return e.k == Expr::K::kNeg ? Value(-v.number()) : v;
        if (v.kind() == Value::Kind::kBool) return Value(static_cast<int64_t>(e.k == Expr::K::kNeg ? -v.boolean() : v.boolean()));
        return Error(e.line, "bad operand type for unary -: '" + v.TypeName() + "'");
      }
      case Expr::K::kNot: {
        PAGEKV_ASSIGN_OR_RETURN(Value v, Eval(*e.args[0]));
        return Value(!v.Truthy());
      }
      case Expr::K::kAnd:
      case Expr::K::kOr: {
        PAGEKV_ASSIGN_OR_RETURN(Value a, Eval(*e.args[0]));
        if (a.Truthy() == (e.k == Expr::K::kOr)) return a;
        return Eval(*e.args[1]);
      }
      case Expr::K::kBinary: {
        PAGEKV_ASSIGN_OR_RETURN(Value a, Eval(*e.args[0]));
        PAGEKV_ASSIGN_OR_RETURN(Value b, Eval(*e.args[1]));
        if (e.name == "~") return Value((a.is_undefined() ? std::string() : a.Str()) + (b.is_undefined() ? std::string() : b.Str()));
        if (e.name == "%" && a.is_string()) return Error(e.line, "'%' string formatting is not supported (use ~ or format)");
        return Arith(e.name, a, b, e.line);
      }
      case Expr::K::kCompare: {
        PAGEKV_ASSIGN_OR_RETURN(Value left, Eval(*e.args[0]));
        for (size_t i = 0; i < e.ops.size(); ++i) {
          PAGEKV_ASSIGN_OR_RETURN(Value right, Eval(*e.args[i + 1]));
          const std::string& op = e.ops[i];
          bool r;
          if (op == "==") {
            r = Equal(left, right);
          } else if (op == "!=") {
            r = !Equal(left, right);
          } else if (op == "in" || op == "not in") {
            PAGEKV_ASSIGN_OR_RETURN(bool in, Contains(right, left, e.line));
            r = (op == "in") == in;
          } else {
            PAGEKV_ASSIGN_OR_RETURN(int o, Order(left, right, e.line));
            r = op == "<" ? o < 0 : op == ">" ? o > 0 : op == "<=" ? o <= 0 : o >= 0;
          }
          if (!r) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case Expr::K::kCond: {
        PAGEKV_ASSIGN_OR_RETURN(Value c, Eval(*e.args[0]));
        if (c.Truthy()) return Eval(*e.args[1]);
        if (e.args.size() > 2) return Eval(*e.args[2]);
        return Value();
      }
      case Expr::K::kList:
      case Expr::K::kTuple: {
        List l;
        for (const auto& x : e.args) {
          PAGEKV_ASSIGN_OR_RETURN(Value v, Eval(*x));
          l.push_back(std::move(v));
        }
        return Value(std::move(l));
      }
      case Expr::K::kDict: {
        Dict d;
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          PAGEKV_ASSIGN_OR_RETURN(Value k, Eval(*e.args[i]));
          PAGEKV_ASSIGN_OR_RETURN(Value v, Eval(*e.args[i + 1]));
          if (!k.is_string()) return Error(e.line, "dict keys must be strings here, not " + k.TypeName());
          d.Set(k.str(), std::move(v));
        }
        return Value(std::move(d));
      }
    }
    return Value();
  }

  static bool IsMethod(const Value& obj, const std::string& name) {
    static const char* kStr[] = {"strip", "lstrip", "rstrip", "split", "rsplit", "startswith", "endswith", "upper",
                                 "lower", "title", "capitalize", "replace", "find", "count", "join", "splitlines"};
    static const char* kDict[] = {"get", "items", "keys", "values"};
    static const char* kList[] = {"index", "count"};
    auto in = [&](const auto& names) {
      for (const char* n : names) {
        if (name == n) return true;
      }
      return false;
    };
    return obj.is_string() ? in(kStr) : obj.is_dict() ? in(kDict) : obj.is_list() ? in(kList) : false;
  }

  Value Attribute(const Value& obj, const std::string& name) {
    if (!obj.is_namespace() && IsMethod(obj, name)) {  // a method not called here: a bound function
      return Value::Func([this, obj, name](Args a, Kwargs kw) -> Result<Value> {
        std::optional<Result<Value>> r = Method(obj, name, a, kw, 0);
        return r ? std::move(*r) : Result<Value>(InvalidArgumentError("chat template: no method " + name));
      });
    }
    if (obj.is_dict()) {
      if (const Value* v = obj.dict().Find(name)) return *v;
    }
    return Value();
  }

  Result<Value> Item(const Value& obj, const Value& key, int line) {
    if (obj.is_dict()) {
      if (!key.is_string()) return Value();
      if (const Value* v = obj.dict().Find(key.str())) return *v;
      return Value();
    }
    if (obj.is_list() || obj.is_string()) {
      if (key.kind() != Value::Kind::kInt) {
        if (key.is_string()) return Attribute(obj, key.str());
        return Error(line, "indexes must be integers, not " + key.TypeName());
      }
      std::vector<std::string> chars;
      if (obj.is_string()) chars = Chars(obj.str());
      const auto n = static_cast<int64_t>(obj.is_string() ? chars.size() : obj.list().size());
      int64_t i = key.integer();
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value();
      if (obj.is_string()) return Value(chars[static_cast<size_t>(i)]);
      return obj.list()[static_cast<size_t>(i)];
    }
    return Value();
  }

  std::optional<Result<Value>> Method(const Value& obj, const std::string& name, const Args& a, const Kwargs& kw, int line) {
    if (!IsMethod(obj, name)) return std::nullopt;
    auto str_arg = [&](size_t i, std::string_view k) -> const Value* {
      const Value* v = Arg(a, i, kw, k);
      return v != nullptr && v->is_string() ? v : nullptr;
    };
    if (obj.is_string()) {
      const std::string& s = obj.str();
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        const Value* chars = Arg(a, 0, kw, "chars");
        return Result<Value>(Value(Strip(s, chars, name != "rstrip", name != "lstrip")));
      }
      if (name == "split" || name == "rsplit") {
        const Value* sep = Arg(a, 0, kw, "sep");
        const Value* max = Arg(a, 1, kw, "maxsplit");
        if (sep != nullptr && !sep->is_none() && (!sep->is_string() || sep->str().empty())) {
          return Result<Value>(Error(line, "split() needs a non-empty string separator"));
        }
        const int64_t maxsplit = max != nullptr && max->kind() == Value::Kind::kInt ? max->integer() : -1;
        std::vector<std::string> parts;
        if (name == "rsplit" && maxsplit >= 0 && sep != nullptr && sep->is_string()) {
          // From the right: split all, then join the leading surplus back.
          parts = Split(s, sep, -1);
          while (static_cast<int64_t>(parts.size()) > maxsplit + 1) {
            parts[0] += sep->str() + parts[1];
            parts.erase(parts.begin() + 1);
          }
        } else {
          parts = Split(s, sep, maxsplit);
        }
        List l;
        for (std::string& p : parts) l.emplace_back(std::move(p));
        return Result<Value>(Value(std::move(l)));
      }
      if (name == "startswith" || name == "endswith") {
        const Value* x = Arg(a, 0, kw, "prefix");
        if (x == nullptr) return Result<Value>(Error(line, name + "() takes an argument"));
        List options = x->is_list() ? x->list() : List{*x};
        for (const Value& o : options) {
          if (!o.is_string()) return Result<Value>(Error(line, name + "() takes strings"));
          const std::string& p = o.str();
          const bool hit = name == "startswith" ? s.compare(0, p.size(), p) == 0
                                                : s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
          if (hit) return Result<Value>(Value(true));
        }
        return Result<Value>(Value(false));
      }
      if (name == "upper") return Result<Value>(Value(AsciiMap(s, [](int c) { return std::toupper(c); })));
      if (name == "lower") return Result<Value>(Value(AsciiMap(s, [](int c) { return std::tolower(c); })));
      if (name == "title") return Result<Value>(Value(Title(s)));
      if (name == "capitalize") return Result<Value>(Value(Capitalize(s)));
      if (name == "replace") {
        const Value* from = str_arg(0, "old");
        const Value* to = str_arg(1, "new");
        if (from == nullptr || to == nullptr) return Result<Value>(Error(line, "replace() takes two strings"));
        return Result<Value>(Value(ReplaceAll(s, from->str(), to->str(), -1)));
      }
      if (name == "find" || name == "count") {
        const Value* sub = str_arg(0, "sub");
        if (sub == nullptr) return Result<Value>(Error(line, name + "() takes a string"));
        if (name == "find") {
          const size_t at = s.find(sub->str());
          if (at == std::string::npos) return Result<Value>(Value(int64_t{-1}));
          return Result<Value>(Value(static_cast<int64_t>(Chars(s.substr(0, at)).size())));
        }
        int64_t n = 0;
        if (sub->str().empty()) return Result<Value>(Value(static_cast<int64_t>(Chars(s).size()) + 1));
        for (size_t at = s.find(sub->str()); at != std::string::npos; at = s.find(sub->str(), at + sub->str().size())) ++n;
        return Result<Value>(Value(n));
      }
      if (name == "join") {
        const Value* items = Arg(a, 0, kw, "iterable");
        if (items == nullptr) return Result<Value>(Error(line, "join() takes an iterable"));
        Result<List> l = Iterate(*items, line);
        if (!l.ok()) return Result<Value>(l.status());
        std::string out;
        for (size_t i = 0; i < l->size(); ++i) out += (i == 0 ? "" : s) + (*l)[i].Str();
        return Result<Value>(Value(std::move(out)));
      }
      if (name == "splitlines") {
        List l;
        size_t at = 0;
        while (at < s.size()) {
          size_t e = s.find_first_of("\r\n", at);
          if (e == std::string::npos) {
            l.emplace_back(s.substr(at));
            break;
          }
          l.emplace_back(s.substr(at, e - at));
          at = e + (s[e] == '\r' && e + 1 < s.size() && s[e + 1] == '\n' ? 2 : 1);
        }
        return Result<Value>(Value(std::move(l)));
      }
    }
    if (obj.is_dict()) {
      const Dict& d = obj.dict();
      if (name == "get") {
        const Value* key = Arg(a, 0, kw, "key");
        const Value* def = Arg(a, 1, kw, "default");
        if (key != nullptr && key->is_string()) {
          if (const Value* v = d.Find(key->str())) return Result<Value>(*v);
        }
        return Result<Value>(def != nullptr ? *def : Value::None());
      }
      List l;
      for (const auto& [k, v] : d.items) {
        if (name == "items") l.emplace_back(List{Value(k), v});
        if (name == "keys") l.emplace_back(k);
        if (name == "values") l.push_back(v);
      }
      return Result<Value>(Value(std::move(l)));
    }
    if (obj.is_list()) {
      const Value* x = Arg(a, 0, kw, "value");
      if (x == nullptr) return Result<Value>(Error(line, name + "() takes a value"));
      int64_t n = 0;
      for (size_t i = 0; i < obj.list().size(); ++i) {
        if (!Equal(obj.list()[i], *x)) continue;
        if (name == "index") return Result<Value>(Value(static_cast<int64_t>(i)));
        ++n;
      }
      if (name == "index") return Result<Value>(Error(line, "index(): the value is not in the list"));
      return Result<Value>(Value(n));
    }
    return std::nullopt;
  }

  static std::string ReplaceAll(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
    if (from.empty()) return s;
    std::string out;
    size_t at = 0;
    int64_t done = 0;
    for (size_t f = s.find(from); f != std::string::npos && (count < 0 || done < count); f = s.find(from, at)) {
      out += s.substr(at, f - at) + to;
      at = f + from.size();
      ++done;
    }
    return out + s.substr(at);
  }

  Result<bool> Test(const std::string& name, const Value& v, const Args& a, int line) {
    using K = Value::Kind;
    auto arg = [&]() -> Result<Value> {
      if (a.empty()) return Error(line, "the test '" + name + "' takes an argument");
      return a[0];
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "boolean") return v.kind() == K::kBool;
    if (name == "true") return v.kind() == K::kBool && v.boolean();
    if (name == "false") return v.kind() == K::kBool && !v.boolean();
    if (name == "integer") return v.kind() == K::kInt;
    if (name == "float") return v.kind() == K::kFloat;
    if (name == "number") return v.is_number() || v.kind() == K::kBool;
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.is_dict() && !v.is_namespace();
    if (name == "iterable" || name == "sequence") return v.is_string() || v.is_list() || (v.is_dict() && !v.is_namespace());
    if (name == "callable") return v.kind() == K::kFunction;
    if (name == "lower" || name == "upper") {
      if (!v.is_string()) return false;
      const std::string s = name == "lower" ? AsciiMap(v.str(), [](int c) { return std::tolower(c); })
                                            : AsciiMap(v.str(), [](int c) { return std::toupper(c); });
      return s == v.str();
    }
    if (name == "even" || name == "odd" || name == "divisibleby") {
      if (v.kind() != K::kInt) return Error(line, "the test '" + name + "' needs an integer");
      if (name == "divisibleby") {
        PAGEKV_ASSIGN_OR_RETURN(Value d, arg());
        if (d.kind() != K::kInt || d.integer() == 0) return Error(line, "divisibleby needs a non-zero integer");
        return v.integer() % d.integer() == 0;
      }
      return (v.integer() % 2 == 0) == (name == "even");
    }
    if (name == "sameas") {
      PAGEKV_ASSIGN_OR_RETURN(Value o, arg());
      if (v.kind() != o.kind()) return false;
      if (v.is_none() || v.is_undefined()) return true;
      if (v.kind() == K::kBool) return v.boolean() == o.boolean();
      if (v.is_list()) return &v.list() == &o.list();
      if (v.is_dict()) return &v.dict() == &o.dict();
      return Equal(v, o);
    }
    if (name == "equalto" || name == "eq" || name == "==") {
      PAGEKV_ASSIGN_OR_RETURN(Value o, arg());
      return Equal(v, o);
    }
    if (name == "ne" || name == "!=") {
      PAGEKV_ASSIGN_OR_RETURN(Value o, arg());
      return !Equal(v, o);
    }
    if (name == "lt" || name == "le" || name == "gt" || name == "ge" || name == "<" || name == "<=" || name == ">" || name == ">=") {
      PAGEKV_ASSIGN_OR_RETURN(Value o, arg());
      PAGEKV_ASSIGN_OR_RETURN(int c, Order(v, o, line));
      if (name == "lt" || name == "<") return c < 0;
      if (name == "le" || name == "<=") return c <= 0;
      if (name == "gt" || name == ">") return c > 0;
      return c >= 0;
    }
    if (name == "in") {
      PAGEKV_ASSIGN_OR_RETURN(Value o, arg());
      return Contains(o, v, line);
    }
    return Error(line, "the test '" + name + "' is not supported by PageKV's chat-template renderer");
  }

  // Runs a filter by name on `input` with arguments (for select / map).
  Result<Value> Filter(const std::string& name, Value input, const Args& a, const Kwargs& kw, int line) {
    using K = Value::Kind;
    auto want_list = [&]() -> Result<List> { return Iterate(input, line); };
    if (name == "trim") return Value(Strip(input.Str(), Arg(a, 0, kw, "chars"), true, true));
    if (name == "length" || name == "count") return Length(input, line);
    if (name == "string") return Value(input.is_undefined() ? std::string() : input.Str());
    if (name == "safe" || name == "e" || name == "escape") {
      if (name == "safe") return input;
      return Error(line, "the filter '" + name + "' is not supported (chat templates render plain text)");
    }
    if (name == "upper") return Value(AsciiMap(input.Str(), [](int c) { return std::toupper(c); }));
    if (name == "lower") return Value(AsciiMap(input.Str(), [](int c) { return std::tolower(c); }));
    if (name == "title") return Value(Title(input.Str()));
    if (name == "capitalize") return Value(Capitalize(input.Str()));
    if (name == "tojson") {
      const Value* indent = Arg(a, 0, kw, "indent");
      const Value* ascii = Kwarg(kw, "ensure_ascii");
      if (ascii != nullptr && ascii->Truthy()) return Error(line, "tojson(ensure_ascii=true) is not supported");
      PAGEKV_ASSIGN_OR_RETURN(std::string j, input.ToJson(indent != nullptr && indent->kind() == K::kInt ? static_cast<int>(indent->integer()) : -1));
      return Value(std::move(j));
    }
    if (name == "default" || name == "d") {
      const Value* def = Arg(a, 0, kw, "default_value");
      const Value* boolean = Arg(a, 1, kw, "boolean");
      const bool use = input.is_undefined() || (boolean != nullptr && boolean->Truthy() && !input.Truthy());
      return use ? (def != nullptr ? *def : Value(std::string())) : input;
    }
    if (name == "list") {
      PAGEKV_ASSIGN_OR_RETURN(List l, want_list());
      return Value(std::move(l));
    }
    if (name == "first" || name == "last") {
      PAGEKV_ASSIGN_OR_RETURN(List l, want_list());
      if (l.empty()) return Value();
      return name == "first" ? l.front() : l.back();
    }
    if (name == "reverse") {
      if (input.is_string()) {
        std::vector<std::string> cs = Chars(input.str());
        std::string out;
        for (auto it = cs.rbegin(); it != cs.rend(); ++it) out += *it;
        return Value(std::move(out));
      }
      PAGEKV_ASSIGN_OR_RETURN(List l, want_list());
      std::reverse(l.begin(), l.end());
      return Value(std::move(l));
    }
    if (name == "join") {
      PAGEKV_ASSIGN_OR_RETURN(List l, want_list());
      const Value* sep = Arg(a, 0, kw, "d");
      const Value* attribute = Arg(a, 1, kw, "attribute");
      std::string out;
      for (size_t i = 0; i < l.size(); ++i) {
        Value x = l[i];
        if (attribute != nullptr && attribute->is_string()) x = Attribute(x, attribute->str());
        out += (i == 0 || sep == nullptr ? "" : sep->Str()) + (x.is_undefined() ? std::string() : x.Str());
      }
      return Value(std::move(out));
    }
    if (name == "items") {
      if (input.is_undefined()) return Value(List{});
      if (!input.is_dict()) return Error(line, "the items filter needs a mapping, not " + input.TypeName());
      List l;
      for (const auto& [k, v] : input.dict().items) l.emplace_back(List{Value(k), v});
      return Value(std::move(l));
    }
    if (name == "dictsort") {
      if (!input.is_dict()) return Error(line, "dictsort needs a mapping");
      const Value* by = Arg(a, 1, kw, "by");
      const bool by_value = by != nullptr && by->is_string() && by->str() == "value";
      const Value* rev = Arg(a, 2, kw, "reverse");
      List l;
      for (const auto& [k, v] : input.dict().items) l.emplace_back(List{Value(k), v});
      Status err = Status::Ok();
      std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) {
        Result<int> o = Order(x.list()[by_value ? 1 : 0], y.list()[by_value ? 1 : 0], line);
        if (!o.ok()) err = o.status();
        return o.ok() && *o < 0;
      });
      PAGEKV_RETURN_IF_ERROR(err);
      if (rev != nullptr && rev->Truthy()) std::reverse(l.begin(), l.end());
      return Value(std::move(l));
    }
    if (name == "sort" || name == "unique" || name == "max" || name == "min") {
      PAGEKV_ASSIGN_OR_RETURN(List l, want_list());
      const Value* attribute = Kwarg(kw, "attribute");
      auto key = [&](const Value& x) { return attribute != nullptr && attribute->is_string() ? Attribute(x, attribute->str()) : x; };
      if (name == "unique") {
        List out;
        for (const Value& x : l) {
          bool seen = false;
          for (const Value& y : out) seen = seen || Equal(key(x), key(y));
          if (!seen) out.push_back(x);
        }
        return Value(std::move(out));
      }
      Status err = Status::Ok();
      auto less = [&](const Value& x, const Value& y) {
        Result<int> o = Order(key(x), key(y), line);
        if (!o.ok()) err = o.status();
        return o.ok() && *o < 0;
      };
      if (name == "sort") {
        std::stable_sort(l.begin(), l.end(), less);
        PAGEKV_RETURN_IF_ERROR(err);
        const Value* rev = Arg(a, 0, kw, "reverse");
        if (rev != nullptr && rev->Truthy()) std::reverse(l.begin(), l.end());
        return Value(std::move(l));
      }
      if (l.empty()) return Value();
      auto it = name == "max" ? std::max_element(l.begin(), l.end(), less) : std::min_element(l.begin(), l.end(), less);
      PAGEKV_RETURN_IF_ERROR(err);
      return *it;
    }
    if (name == "sum") {
      PAGEKV_ASSIGN_OR_RETURN(List l, want_list());
      const Value* attribute = Kwarg(kw, "attribute");
      const Value* start = Kwarg(kw, "start");
      Value total = start != nullptr ? *start : Value(int64_t{0});
      for (const Value& x : l) {
        PAGEKV_ASSIGN_OR_RETURN(total, Arith("+", total, attribute != nullptr && attribute->is_string() ? Attribute(x, attribute->str()) : x, line));
      }
      return total;
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      PAGEKV_ASSIGN_OR_RETURN(List l, want_list());
      const bool attr = name.size() > 6;
      const bool keep_if = name[0] == 's';
      size_t at = 0;
      std::string attribute;
      if (attr) {
        if (a.empty() || !a[0].is_string()) return Error(line, name + " needs an attribute name");
        attribute = a[0].str();
        at = 1;
      }
      std::string test = a.size() > at && a[at].is_string() ? a[at].str() : "";
      Args test_args(a.begin() + static_cast<std::ptrdiff_t>(std::min(a.size(), at + 1)), a.end());
      List out;
      for (const Value& x : l) {
        const Value v = attr ? Attribute(x, attribute) : x;
        bool pass;
        if (test.empty()) {
          pass = v.Truthy();
        } else {
          PAGEKV_ASSIGN_OR_RETURN(pass, Test(test, v, test_args, line));
        }
        if (pass == keep_if) out.push_back(x);
      }
      return Value(std::move(out));
    }
    if (name == "map") {
      PAGEKV_ASSIGN_OR_RETURN(List l, want_list());
      const Value* attribute = Kwarg(kw, "attribute");
      List out;
      if (attribute != nullptr && attribute->is_string()) {
        const Value* def = Kwarg(kw, "default");
        for (const Value& x : l) {
          Value v = Attribute(x, attribute->str());
          out.push_back(v.is_undefined() && def != nullptr ? *def : v);
        }
        return Value(std::move(out));
      }
      if (a.empty() || !a[0].is_string()) return Error(line, "map needs a filter name or attribute=");
      Args rest(a.begin() + 1, a.end());
      for (const Value& x : l) {
        PAGEKV_ASSIGN_OR_RETURN(Value v, Filter(a[0].str(), x, rest, kw, line));
        out.push_back(std::move(v));
      }
      return Value(std::move(out));
    }
    if (name == "attr") {
      const Value* n = Arg(a, 0, kw, "name");
      if (n == nullptr || !n->is_string()) return Error(line, "attr needs a name");
      return Attribute(input, n->str());
    }
    if (name == "replace") {
      const Value* from = Arg(a, 0, kw, "old");
      const Value* to = Arg(a, 1, kw, "new");
      const Value* count = Arg(a, 2, kw, "count");
      if (from == nullptr || to == nullptr || !from->is_string() || !to->is_string()) {
        return Error(line, "replace needs two strings");
      }
      return Value(ReplaceAll(input.Str(), from->str(), to->str(), count != nullptr && count->kind() == K::kInt ? count->integer() : -1));
    }
    if (name == "int") {
      const Value* def = Arg(a, 0, kw, "default");
      if (input.kind() == K::kInt) return input;
      if (input.kind() == K::kBool) return Value(static_cast<int64_t>(input.boolean()));
      if (input.kind() == K::kFloat) return Value(static_cast<int64_t>(std::trunc(input.number())));
      if (input.is_string()) {
        const std::string s = Strip(input.str(), nullptr, true, true);
        char* end = nullptr;
        errno = 0;
        const long long v = std::strtoll(s.c_str(), &end, 10);
        if (!s.empty() && *end == '\0' && errno == 0) return Value(static_cast<int64_t>(v));
        const double f = std::strtod(s.c_str(), &end);
        if (!s.empty() && *end == '\0' && std::isfinite(f)) return Value(static_cast<int64_t>(std::trunc(f)));
      }
      return def != nullptr ? *def : Value(int64_t{0});
    }
    if (name == "float") {
      const Value* def = Arg(a, 0, kw, "default");
      if (input.is_number()) return Value(input.number());
      if (input.kind() == K::kBool) return Value(input.boolean() ? 1.0 : 0.0);
      if (input.is_string()) {
        const std::string s = Strip(input.str(), nullptr, true, true);
        char* end = nullptr;
        const double f = std::strtod(s.c_str(), &end);
        if (!s.empty() && *end == '\0') return Value(f);
      }
      return def != nullptr ? *def : Value(0.0);
    }
    if (name == "abs") {
      if (input.kind() == K::kInt) return Value(input.integer() < 0 ? -input.integer() : input.integer());
      if (input.kind() == K::kFloat) return Value(std::fabs(input.number()));
      return Error(line, "abs needs a number");
    }
    if (name == "round") {
      const Value* precision = Arg(a, 0, kw, "precision");
      const Value* method = Arg(a, 1, kw, "method");
      if (!input.is_number()) return Error(line, "round needs a number");
      const double scale = std::pow(10.0, precision != nullptr && precision->kind() == K::kInt ? static_cast<double>(precision->integer()) : 0.0);
      const std::string m = method != nullptr && method->is_string() ? method->str() : "common";
      const double x = input.number() * scale;
      const double r = m == "ceil" ? std::ceil(x) : m == "floor" ? std::floor(x) : std::nearbyint(x);
      return Value(r / scale);
    }
    if (name == "indent") {
      const Value* width = Arg(a, 0, kw, "width");
      const Value* first = Arg(a, 1, kw, "first");
      const Value* blank = Arg(a, 2, kw, "blank");
      const std::string pad = width != nullptr && width->is_string() ? width->str()
                                  : std::string(static_cast<size_t>(width != nullptr && width->kind() == K::kInt ? std::max<int64_t>(0, width->integer()) : 4), ' ');
      const std::string s = input.Str();
      std::string out;
      size_t at = 0;
      bool first_line = true;
      while (true) {
        const size_t e = s.find('\n', at);
        const std::string line_text = s.substr(at, e == std::string::npos ? std::string::npos : e - at);
        const bool add = first_line ? (first != nullptr && first->Truthy()) : (!line_text.empty() || (blank != nullptr && blank->Truthy()));
        out += (add ? pad : "") + line_text;
        if (e == std::string::npos) break;
        out += '\n';
        at = e + 1;
        first_line = false;
      }
      return Value(std::move(out));
    }
    if (name == "wordcount") return Value(static_cast<int64_t>(Split(input.Str(), nullptr, -1).size()));
    return Error(line, "the filter '" + name + "' is not supported by PageKV's chat-template renderer");
  }

  Result<Value> ApplyFilter(const Expr& f, Value input) {
    Args a;
    Kwargs kw;
    for (size_t i = f.has_input ? 1 : 0; i < f.args.size(); ++i) {
      PAGEKV_ASSIGN_OR_RETURN(Value v, Eval(*f.args[i]));
      a.push_back(std::move(v));
    }
    for (const auto& [k, x] : f.kwargs) {
      PAGEKV_ASSIGN_OR_RETURN(Value v, Eval(*x));
      kw.emplace_back(k, std::move(v));
    }
    return Filter(f.name, std::move(input), a, kw, f.line);
  }

 private:
  const Value& context_;
  std::vector<Frame> frames_;
  int loops_ = 0;
  int depth_ = 0;
};

}  // namespace

Result<std::string> Template::Render(const Value& context) const {
  if (!context.is_dict()) return InvalidArgumentError("chat template: the variables must be a mapping");
  Renderer r(context);
  std::string out;
  PAGEKV_RETURN_IF_ERROR(r.Run(*root_, out));
  return out;
}

}  // namespace pagekv::jinja
