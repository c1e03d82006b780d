// The methods, attributes, items, tests and filters of the chat-template
// renderer (builtins.h; the lists in jinja.h).
#include <algorithm>
#include <climits>
#include <cmath>

#include "jinja/builtins.h"

namespace pagekv::jinja::builtins {

bool IsMethod(const Value& obj, const std::string& name) {
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
    return Value::Func([obj, name](Args a, Kwargs kw) -> Result<Value> {
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
    const auto n = static_cast<int64_t>(obj.is_string() ? CountChars(obj.str()) : obj.list().size());
    int64_t i = key.integer();
    if (i < 0) i += n;
    if (i < 0 || i >= n) return Value();
    if (obj.is_string()) {  // the i-th code point, found without a list of them all
      const std::string& s = obj.str();
      size_t at = 0;
      for (int64_t k = 0; k < i; ++k) at += CharLen(s, at);
      return Value(s.substr(at, CharLen(s, at)));
    }
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
      const bool from_right = name == "rsplit" && maxsplit >= 0 && sep != nullptr && sep->is_string();
      Result<std::vector<std::string>> split = Split(s, sep, from_right ? -1 : maxsplit, line);
      if (from_right) {
        // From the right: split all, then join the leading surplus back.
        if (split.ok() && static_cast<int64_t>(split->size()) > maxsplit + 1) {
          std::vector<std::string>& p = *split;
          const size_t surplus = p.size() - static_cast<size_t>(maxsplit);  // parts joined into the first
          for (size_t i = 1; i < surplus; ++i) p[0].append(sep->str()).append(p[i]);
          p.erase(p.begin() + 1, p.begin() + static_cast<std::ptrdiff_t>(surplus));
        }
      }
      if (!split.ok()) return Result<Value>(split.status());
      std::vector<std::string>& parts = *split;
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
      Result<std::string> r = ReplaceAll(s, from->str(), to->str(), -1, line);
      if (!r.ok()) return Result<Value>(r.status());
      return Result<Value>(Value(std::move(*r)));
    }
    if (name == "find" || name == "count") {
      const Value* sub = str_arg(0, "sub");
      if (sub == nullptr) return Result<Value>(Error(line, name + "() takes a string"));
      if (name == "find") {
        const size_t at = s.find(sub->str());
        if (at == std::string::npos) return Result<Value>(Value(int64_t{-1}));
        return Result<Value>(Value(static_cast<int64_t>(CountChars(std::string_view(s).substr(0, at)))));
      }
      int64_t n = 0;
      if (sub->str().empty()) return Result<Value>(Value(static_cast<int64_t>(CountChars(s)) + 1));
      for (size_t at = s.find(sub->str()); at != std::string::npos; at = s.find(sub->str(), at + sub->str().size())) ++n;
      return Result<Value>(Value(n));
    }
    if (name == "join") {
      const Value* items = Arg(a, 0, kw, "iterable");
      if (items == nullptr) return Result<Value>(Error(line, "join() takes an iterable"));
      Result<List> l = Iterate(*items, line);
      if (!l.ok()) return Result<Value>(l.status());
      std::string out;
      for (size_t i = 0; i < l->size(); ++i) {
        if (i > 0) out += s;
        out += (*l)[i].Str();
        if (out.size() > kMaxValueBytes) return Result<Value>(Error(line, "join() makes a string larger than 16 MiB"));
      }
      return Result<Value>(Value(std::move(out)));
    }
    if (name == "splitlines") {
      List l;
      size_t at = 0;
      while (at < s.size()) {
        if (l.size() >= kMaxItems) {
          return Result<Value>(Error(line, "splitlines() into more than " + std::to_string(kMaxItems) + " lines"));
        }
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

Result<std::string> ReplaceAll(const std::string& s, const std::string& from, const std::string& to, int64_t count,
                               int line) {
  if (from.empty()) return s;
  std::string out;
  size_t at = 0;
  int64_t done = 0;
  for (size_t f = s.find(from); f != std::string::npos && (count < 0 || done < count); f = s.find(from, at)) {
    out.append(s, at, f - at).append(to);
    if (out.size() > kMaxValueBytes) return Error(line, "replace() makes a string larger than 16 MiB");
    at = f + from.size();
    ++done;
  }
  out.append(s, at);
  if (out.size() > kMaxValueBytes) return Error(line, "replace() makes a string larger than 16 MiB");
  return out;
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
      std::vector<std::string_view> cs = Chars(input.str());
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
    const std::string between = sep == nullptr ? std::string() : sep->Str();
    for (size_t i = 0; i < l.size(); ++i) {
      Value x = l[i];
      if (attribute != nullptr && attribute->is_string()) x = Attribute(x, attribute->str());
      if (i > 0) out += between;
      if (!x.is_undefined()) out += x.Str();
      if (out.size() > kMaxValueBytes) return Error(line, "join makes a string larger than 16 MiB");
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
    PAGEKV_ASSIGN_OR_RETURN(std::string r, ReplaceAll(input.Str(), from->str(), to->str(),
                                                      count != nullptr && count->kind() == K::kInt ? count->integer() : -1, line));
    return Value(std::move(r));
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
    const int64_t spaces = width != nullptr && width->kind() == K::kInt ? std::max<int64_t>(0, width->integer()) : 4;
    if (spaces > static_cast<int64_t>(kMaxValueBytes)) return Error(line, "indent wider than 16 MiB");
    const std::string pad = width != nullptr && width->is_string() ? width->str() : std::string(static_cast<size_t>(spaces), ' ');
    const std::string s = input.Str();
    std::string out;
    size_t at = 0;
    bool first_line = true;
    while (true) {
      const size_t e = s.find('\n', at);
      const std::string line_text = s.substr(at, e == std::string::npos ? std::string::npos : e - at);
      const bool add = first_line ? (first != nullptr && first->Truthy()) : (!line_text.empty() || (blank != nullptr && blank->Truthy()));
      if (add) out += pad;
      out += line_text;
      if (out.size() > kMaxValueBytes) return Error(line, "indent makes a string larger than 16 MiB");
      if (e == std::string::npos) break;
      out += '\n';
      at = e + 1;
      first_line = false;
    }
    return Value(std::move(out));
  }
  if (name == "wordcount") {
    PAGEKV_ASSIGN_OR_RETURN(std::vector<std::string> words, Split(input.Str(), nullptr, -1, line));
    return Value(static_cast<int64_t>(words.size()));
  }
  return Error(line, "the filter '" + name + "' is not supported by PageKV's chat-template renderer");
}

}  // namespace pagekv::jinja::builtins
