// jinja::Value (jinja.h): Python's semantics for the values chat templates
// handle: truthiness, str() / repr(), json.dumps, equality.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "jinja/jinja.h"

namespace pagekv::jinja {

const Value* Dict::Find(std::string_view key) const {
  for (const auto& [k, v] : items) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Dict::Set(const std::string& key, Value v) {
  for (auto& [k, old] : items) {
    if (k == key) {
      old = std::move(v);
      return;
    }
  }
  items.emplace_back(key, std::move(v));
}

Value Value::None() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}
namespace {

constexpr uint64_t kBytesCap = uint64_t{1} << 62;
uint64_t AddBytes(uint64_t a, uint64_t b) { return std::min(kBytesCap, a + std::min(kBytesCap, b)); }

}  // namespace

Value::Value() : repr_bytes_(4) {}
Value::Value(bool b) : kind_(Kind::kBool), b_(b) { repr_bytes_ = 5; }
Value::Value(int64_t i) : kind_(Kind::kInt), i_(i) {
  char buf[24];
  repr_bytes_ = static_cast<uint64_t>(std::to_chars(buf, buf + sizeof buf, i).ptr - buf);
}
Value::Value(double f) : kind_(Kind::kFloat), f_(f) { repr_bytes_ = 24; }
Value::Value(std::string s) : kind_(Kind::kString), s_(std::make_shared<const std::string>(std::move(s))) {
  repr_bytes_ = AddBytes(2, s_->size());
}
Value::Value(List l) : kind_(Kind::kList), l_(std::make_shared<List>(std::move(l))) {
  uint64_t bytes = 2;
  for (const Value& x : *l_) {
    depth_ = std::max(depth_, x.depth_);
    bytes = AddBytes(bytes, AddBytes(2, x.repr_bytes_));
    holds_namespace_ = holds_namespace_ || x.namespace_ || x.holds_namespace_;
  }
  ++depth_;
  repr_bytes_ = bytes;
}
Value::Value(Dict d) : kind_(Kind::kDict), d_(std::make_shared<Dict>(std::move(d))) {
  uint64_t bytes = 2;
  for (const auto& [k, x] : d_->items) {
    depth_ = std::max(depth_, x.depth_);
    bytes = AddBytes(bytes, AddBytes(k.size() + 6, x.repr_bytes_));
    holds_namespace_ = holds_namespace_ || x.namespace_ || x.holds_namespace_;
  }
  ++depth_;
  repr_bytes_ = bytes;
}

Value Value::Func(Function f) {
  Value v;
  v.kind_ = Kind::kFunction;
  v.fn_ = std::make_shared<Function>(std::move(f));
  v.repr_bytes_ = 10;
  return v;
}

Value Value::Namespace(Dict d) {
  Value v(std::move(d));
  v.namespace_ = true;
  v.depth_ = 1;  // a leaf to everything that recurses (Repr, ToJson, Equal)
  v.repr_bytes_ = 11;
  return v;
}

Result<Value> Value::FromJson(const nlohmann::ordered_json& j) {
  // Depth first with an explicit stack: `j` may nest as deep as its parser
  // allowed; what passes kMaxDepth is refused before any recursion.
  struct Level {
    const nlohmann::ordered_json* j;
    nlohmann::ordered_json::const_iterator it;
    List list;
    Dict dict;
  };
  auto scalar = [](const nlohmann::ordered_json& x) -> Value {
    switch (x.type()) {
      case nlohmann::ordered_json::value_t::boolean: return Value(x.get<bool>());
      case nlohmann::ordered_json::value_t::number_integer: return Value(x.get<int64_t>());
      case nlohmann::ordered_json::value_t::number_unsigned: return Value(static_cast<int64_t>(x.get<uint64_t>()));
      case nlohmann::ordered_json::value_t::number_float: return Value(x.get<double>());
      case nlohmann::ordered_json::value_t::string: return Value(x.get<std::string>());
      default: return None();
    }
  };
  if (!j.is_structured()) return scalar(j);
  std::vector<Level> stack;
  stack.push_back({&j, j.begin(), {}, {}});
  while (true) {
    Level& top = stack.back();
    if (top.it == top.j->end()) {
      Value done = top.j->is_array() ? Value(std::move(top.list)) : Value(std::move(top.dict));
      stack.pop_back();
      if (stack.empty()) return done;
      Level& up = stack.back();
      if (up.j->is_array()) {
        up.list.push_back(std::move(done));
      } else {
        up.dict.items.emplace_back(up.it.key(), std::move(done));
      }
      ++up.it;
      continue;
    }
    const nlohmann::ordered_json& x = *top.it;
    if (x.is_structured()) {
      if (stack.size() >= kMaxDepth) {
        return InvalidArgumentError("chat template: a value nests lists and dicts more than " + std::to_string(kMaxDepth) +
                                    " levels deep");
      }
      stack.push_back({&x, x.begin(), {}, {}});
      continue;
    }
    if (top.j->is_array()) {
      top.list.push_back(scalar(x));
    } else {
      top.dict.items.emplace_back(top.it.key(), scalar(x));
    }
    ++top.it;
  }
}

bool Value::Truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone: return false;
    case Kind::kBool: return b_;
    case Kind::kInt: return i_ != 0;
    case Kind::kFloat: return f_ != 0.0;
    case Kind::kString: return !s_->empty();
    case Kind::kList: return !l_->empty();
    case Kind::kDict: return namespace_ || !d_->items.empty();
    case Kind::kFunction: return true;
  }
  return false;
}

namespace {

// Python's repr(float): the shortest digits that round-trip, in fixed
// notation when the decimal exponent is in (-4, 16], else scientific with
// at least two exponent digits; integral values keep ".0".
std::string FloatRepr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  if (f == 0) return std::signbit(f) ? "-0.0" : "0.0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, f, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // [-]d[.ddd]e[+-]XX
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp = std::stoi(sci.substr(e + 1));
  const int decpt = exp + 1;  // value = 0.digits x 10^decpt
  std::string out = sign;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out.append("0.").append(static_cast<size_t>(-decpt), '0').append(digits);
    } else if (static_cast<size_t>(decpt) >= digits.size()) {
      out.append(digits).append(static_cast<size_t>(decpt) - digits.size(), '0').append(".0");
    } else {
      out.append(digits, 0, static_cast<size_t>(decpt)).append(".").append(digits, static_cast<size_t>(decpt));
    }
  } else {
    out.append(digits, 0, 1);
    if (digits.size() > 1) out.append(".").append(digits, 1);
    char ex[16];
    std::snprintf(ex, sizeof ex, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out.append(ex);
  }
  return out;
}

// Python's repr(str): single quotes unless the text has one and no double.
std::string StrRepr(const std::string& s) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == q) {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      out += b;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += q;
  return out;
}

void JsonString(const std::string& s, std::string& out) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", c);
          out += b;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

// json.dumps's text may not pass the largest value a template may make.
constexpr size_t kMaxJsonBytes = size_t{16} << 20;

Status Json(const Value& v, int indent, int depth, std::string& out) {
  if (depth > 512) return InvalidArgumentError("template: tojson: a value nested deeper than 512 levels");
  if (out.size() > kMaxJsonBytes) return InvalidArgumentError("template: tojson: the JSON text exceeds 16 MiB");
  std::string nl, close;
  if (indent >= 0) {
    if (static_cast<uint64_t>(indent) * static_cast<uint64_t>(depth + 1) > kMaxJsonBytes) {
      return InvalidArgumentError("template: tojson: an indent of " + std::to_string(indent) + " is too wide");
    }
    nl.assign(1, '\n').append(static_cast<size_t>(indent) * static_cast<size_t>(depth + 1), ' ');
    close.assign(1, '\n').append(static_cast<size_t>(indent) * static_cast<size_t>(depth), ' ');
  }
  const char* sep = indent >= 0 ? "," : ", ";
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: out += "null"; return Status::Ok();
    case Value::Kind::kBool: out += v.boolean() ? "true" : "false"; return Status::Ok();
    case Value::Kind::kInt: out += std::to_string(v.integer()); return Status::Ok();
    case Value::Kind::kFloat: {
      const double f = v.number();
      out += std::isnan(f) ? "NaN" : std::isinf(f) ? (f > 0 ? "Infinity" : "-Infinity") : FloatRepr(f);
      return Status::Ok();
    }
    case Value::Kind::kString: JsonString(v.str(), out); return Status::Ok();
    case Value::Kind::kList: {
      if (v.list().empty()) {
        out += "[]";
        return Status::Ok();
      }
      out += '[';
      for (size_t i = 0; i < v.list().size(); ++i) {
        out += i == 0 ? "" : sep;
        out += nl;
        PAGEKV_RETURN_IF_ERROR(Json(v.list()[i], indent, depth + 1, out));
      }
      out += close;
      out += ']';
      return Status::Ok();
    }
    case Value::Kind::kDict: {
      if (v.is_namespace()) return InvalidArgumentError("template: tojson: a namespace is not JSON serializable");
      if (v.dict().items.empty()) {
        out += "{}";
        return Status::Ok();
      }
      out += '{';
      bool first = true;
      for (const auto& [k, x] : v.dict().items) {
        out += first ? "" : sep;
        first = false;
        out += nl;
        JsonString(k, out);
        out += ": ";
        PAGEKV_RETURN_IF_ERROR(Json(x, indent, depth + 1, out));
      }
      out += close;
      out += '}';
      return Status::Ok();
    }
    case Value::Kind::kFunction: return InvalidArgumentError("template: tojson: a function is not JSON serializable");
  }
  return Status::Ok();
}

}  // namespace

std::string Value::Repr() const {
  switch (kind_) {
    case Kind::kUndefined: return "";
    case Kind::kNone: return "None";
    case Kind::kBool: return b_ ? "True" : "False";
    case Kind::kInt: return std::to_string(i_);
    case Kind::kFloat: return FloatRepr(f_);
    case Kind::kString: return StrRepr(*s_);
    case Kind::kList: {
      std::string out = "[";
      for (size_t i = 0; i < l_->size(); ++i) out += (i == 0 ? "" : ", ") + (*l_)[i].Repr();
      return out + "]";
    }
    case Kind::kDict: {
      if (namespace_) return "<Namespace>";
      std::string out = "{";
      bool first = true;
      for (const auto& [k, v] : d_->items) {
        out += (first ? "" : ", ") + StrRepr(k) + ": " + v.Repr();
        first = false;
      }
      return out + "}";
    }
    case Kind::kFunction: return "<function>";
  }
  return "";
}

std::string Value::Str() const { return kind_ == Kind::kString ? *s_ : Repr(); }

Result<std::string> Value::ToJson(int indent) const {
  std::string out;
  PAGEKV_RETURN_IF_ERROR(Json(*this, indent, 0, out));
  if (out.size() > kMaxJsonBytes) return InvalidArgumentError("template: tojson: the JSON text exceeds 16 MiB");
  return out;
}

std::string Value::TypeName() const {
  switch (kind_) {
    case Kind::kUndefined: return "undefined";
    case Kind::kNone: return "NoneType object";
    case Kind::kBool: return "bool object";
    case Kind::kInt: return "int object";
    case Kind::kFloat: return "float object";
    case Kind::kString: return "str object";
    case Kind::kList: return "list object";
    case Kind::kDict: return namespace_ ? "Namespace object" : "dict object";
    case Kind::kFunction: return "function";
  }
  return "object";
}

bool Equal(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.kind() == K::kInt && b.kind() == K::kInt) return a.integer() == b.integer();
    return a.number() == b.number();
  }
  if ((a.kind() == K::kBool && b.is_number()) || (b.kind() == K::kBool && a.is_number())) {
    const double x = a.kind() == K::kBool ? (a.boolean() ? 1 : 0) : a.number();
    const double y = b.kind() == K::kBool ? (b.boolean() ? 1 : 0) : b.number();
    return x == y;
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case K::kUndefined:
    case K::kNone: return true;
    case K::kBool: return a.boolean() == b.boolean();
    case K::kString: return a.str() == b.str();
    case K::kList: {
      if (a.list().size() != b.list().size()) return false;
      for (size_t i = 0; i < a.list().size(); ++i) {
        if (!Equal(a.list()[i], b.list()[i])) return false;
      }
      return true;
    }
    case K::kDict: {
      if (&a.dict() == &b.dict()) return true;
      if (a.is_namespace() || b.is_namespace()) return false;  // compared by identity, as Python does
      if (a.dict().items.size() != b.dict().items.size()) return false;
      for (const auto& [k, v] : a.dict().items) {
        const Value* o = b.dict().Find(k);
        if (o == nullptr || !Equal(v, *o)) return false;
      }
      return true;
    }
    case K::kFunction: return &a.function() == &b.function();
    default: return false;
  }
}

}  // namespace pagekv::jinja
