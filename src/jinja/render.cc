// jinja::Template::Render (jinja.h): a tree-walking evaluator with Python's
// value semantics, Jinja's scoping (loop bodies and macros have their own
// scope; if does not) and the filters, tests, methods and globals jinja.h
// lists.
#include <algorithm>
#include <climits>
#include <cmath>
#include <ctime>
#include <unordered_map>

#include "jinja/builtins.h"

namespace pagekv::jinja {
namespace {

using Node = Template::Node;
using builtins::Args;
using builtins::Kwargs;
using builtins::kMaxItems;
using builtins::kMaxOutput;
using builtins::kMaxValueBytes;
using builtins::Error;
using builtins::Chars;
using builtins::Strip;
using builtins::Split;
using builtins::Arith;
using builtins::Order;
using builtins::Contains;
using builtins::Iterate;
using builtins::Length;
using builtins::Kwarg;
using builtins::Arg;
using builtins::Slice;
using builtins::IsMethod;
using builtins::Attribute;
using builtins::Item;
using builtins::Method;
using builtins::Test;
using builtins::Filter;

constexpr int kMaxDepth = 200;
// A template is as untrusted as the model file it comes in: rendering one
// is bounded in stack, time and memory, whatever it does. Evaluations,
// statements and loop iterations count one step each; a new value (from an
// operator, a filter, a call or a list / dict literal) and the output
// count one step per 16 bytes (Value::repr_bytes). No value may be larger
// than the output may be, or nest deeper than Value::kMaxDepth.
constexpr int kMaxNesting = 512;
constexpr uint64_t kBytesPerStep = 16;
// 4M steps (about 0.3 s in a release build), and 4 more per 16 bytes of the
// variables: a template may read its conversation a few times over.
constexpr uint64_t kBaseSteps = uint64_t{1} << 22;
constexpr uint64_t kStepsPerContextStep = 4;

class Renderer {
 public:
  explicit Renderer(const Value& context)
      : context_(context), max_steps_(kBaseSteps + kStepsPerContextStep * (context.repr_bytes() / kBytesPerStep)) {
    frames_.emplace_back();
  }

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
        for (const auto& [k, v] : d.items) {
          if (v.is_namespace() || v.holds_namespace()) {
            return InvalidArgumentError("chat template: namespace(): '" + k + "' holds a namespace; a namespace may not hold another");
          }
        }
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
          if (l.size() >= kMaxItems) return InvalidArgumentError("chat template: range() of more than 1048576 items");
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
    PAGEKV_RETURN_IF_ERROR(Step(line, s.size() / kBytesPerStep));
    out += s;
    return Status::Ok();
  }

  Status Step(int line, uint64_t n) {
    steps_ += n;
    if (steps_ > max_steps_) {
      return Error(line, "the template ran more than " + std::to_string(max_steps_) +
                             " steps (a loop that does not end? the limit grows with the variables' size)");
    }
    return Status::Ok();
  }

  Status Enter(int line) {
    if (nesting_ >= kMaxNesting) {
      return Error(line, "expressions, blocks and macro calls nested more than " + std::to_string(kMaxNesting) +
                             " levels deep while rendering");
    }
    PAGEKV_RETURN_IF_ERROR(Step(line, 1));
    ++nesting_;  // the caller's to undo, once Enter succeeded
    return Status::Ok();
  }

  // What an operator, method or filter pays for reading `v`: the bytes of a
  // string (scanned, split, searched), one step per item of a list or dict.
  static uint64_t InputSteps(const Value& v) {
    if (v.is_string()) return v.str().size() / kBytesPerStep;
    if (v.is_list()) return v.list().size();
    if (v.is_dict()) return v.dict().items.size();
    return 0;
  }
  Status Read(int line, const Value& v) { return Step(line, InputSteps(v)); }
  Status Read(int line, const Args& a) {
    for (const Value& v : a) PAGEKV_RETURN_IF_ERROR(Read(line, v));
    return Status::Ok();
  }
  Status Read(int line, const Kwargs& kw) {
    for (const auto& kv : kw) PAGEKV_RETURN_IF_ERROR(Read(line, kv.second));
    return Status::Ok();
  }

  // What every value an expression gives must hold, and what a new one costs.
  Status Admit(const Value& v, const Expr& e) {
    if (v.depth() > Value::kMaxDepth) {
      return Error(e.line, "a value nested more than " + std::to_string(Value::kMaxDepth) + " levels deep");
    }
    if (v.repr_bytes() > kMaxValueBytes) return Error(e.line, "a value larger than 16 MiB");
    if (v.is_list() && v.list().size() > kMaxItems) {
      return Error(e.line, "a list of more than " + std::to_string(kMaxItems) + " items");
    }
    switch (e.k) {
      case Expr::K::kBinary:
      case Expr::K::kFilter:
      case Expr::K::kCall:
      case Expr::K::kSlice:
      case Expr::K::kList:
      case Expr::K::kTuple:
      case Expr::K::kDict: return Step(e.line, v.repr_bytes() / kBytesPerStep);
      default: return Status::Ok();
    }
  }

  Status Exec(const Node& n, std::string& out, Flow& flow) {
    PAGEKV_RETURN_IF_ERROR(Enter(n.line));
    Status s = ExecNode(n, out, flow);
    --nesting_;
    return s;
  }

  Status ExecNode(const Node& n, std::string& out, Flow& flow) {
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
        if (v.is_namespace() || v.holds_namespace()) {
          return Error(n.line, "cannot set '" + n.text + "' on '" + n.expr2->name + "' to a value holding a namespace: " +
                                   "a namespace may not hold another (nor itself)");
        }
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
    PAGEKV_RETURN_IF_ERROR(Read(n.line, iterable));
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
      if (Status s = Step(n.line, 8); !s.ok()) {  // the loop variable's dict, a frame
        --loops_;
        return s;
      }
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
    PAGEKV_RETURN_IF_ERROR(Enter(e.line));
    Result<Value> v = EvalNode(e);
    --nesting_;
    if (v.ok()) PAGEKV_RETURN_IF_ERROR(Admit(*v, e));
    return v;
  }

  Result<Value> EvalNode(const Expr& e) {
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
        if (obj.is_string()) PAGEKV_RETURN_IF_ERROR(Read(e.line, obj));  // by code points
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
        if (obj.is_string()) PAGEKV_RETURN_IF_ERROR(Read(e.line, obj));
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
            if (IsMethod(obj, callee.name)) {
              PAGEKV_RETURN_IF_ERROR(Read(e.line, obj));
              PAGEKV_RETURN_IF_ERROR(Read(e.line, a));
              PAGEKV_RETURN_IF_ERROR(Read(e.line, kw));
            }
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
        PAGEKV_RETURN_IF_ERROR(Read(e.line, v));
        PAGEKV_RETURN_IF_ERROR(Read(e.line, a));
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
        PAGEKV_RETURN_IF_ERROR(Read(e.line, a));
        PAGEKV_RETURN_IF_ERROR(Read(e.line, b));
        if (e.name == "~") return Value((a.is_undefined() ? std::string() : a.Str()) + (b.is_undefined() ? std::string() : b.Str()));
        if (e.name == "%" && a.is_string()) return Error(e.line, "'%' string formatting is not supported (use ~ or format)");
        return Arith(e.name, a, b, e.line);
      }
      case Expr::K::kCompare: {
        PAGEKV_ASSIGN_OR_RETURN(Value left, Eval(*e.args[0]));
        for (size_t i = 0; i < e.ops.size(); ++i) {
          PAGEKV_ASSIGN_OR_RETURN(Value right, Eval(*e.args[i + 1]));
          PAGEKV_RETURN_IF_ERROR(Read(e.line, left));
          PAGEKV_RETURN_IF_ERROR(Read(e.line, right));
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
    PAGEKV_RETURN_IF_ERROR(Read(f.line, input));
    PAGEKV_RETURN_IF_ERROR(Read(f.line, a));
    PAGEKV_RETURN_IF_ERROR(Read(f.line, kw));
    return Filter(f.name, std::move(input), a, kw, f.line);
  }

 private:
  const Value& context_;
  std::vector<Frame> frames_;
  int loops_ = 0;
  int depth_ = 0;  // macro calls
  int nesting_ = 0;  // Exec and Eval on the stack
  const uint64_t max_steps_;
  uint64_t steps_ = 0;
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
