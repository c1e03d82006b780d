// jinja::Template::Parse (jinja.h): the parser over the lexer's tokens
// (lexer.h) into the tree render.cc walks.
#include "jinja/ast.h"
#include "jinja/lexer.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <optional>
#include <unordered_map>

namespace pagekv::jinja {

Status SyntaxError(int line, const std::string& what) {
  return InvalidArgumentError("chat template line " + std::to_string(line) + ": " + what);
}

namespace {

using Node = Template::Node;
using NodePtr = std::shared_ptr<Node>;

// ---------------------------------------------------------------------------
// Parser

class Parser {
 public:
  explicit Parser(std::vector<Token> t) : t_(std::move(t)) {}

  Result<NodePtr> Run() {
    std::string end;
    Result<NodePtr> body = Body({}, &end);
    if (!too_deep_.ok()) return too_deep_;
    if (!body.ok()) return body.status();
    if (!end.empty()) return SyntaxError(Cur().line, "unexpected {% " + end + " %}");
    return body;
  }

  // A template is no more trusted than the model file it comes in: its
  // trees stay shallow enough for the recursive parser, renderer and
  // destructors. Parentheses, brackets, calls, unary operators and blocks
  // count one level each (kMaxNesting, while parsing); an expression's tree
  // may not grow deeper than kMaxExprDepth (a chain of 1,000 '+' is parsed
  // by a loop, but evaluated by recursion).
  static constexpr int kMaxNesting = 128;
  static constexpr uint32_t kMaxExprDepth = 256;

 private:
  // One level of nesting for the guarded scope; its error once past the limit.
  class Nest {
   public:
    Nest(Parser& p, int line) : p_(p) {
      if (++p_.nest_ > kMaxNesting) {
        status_ = SyntaxError(line, "expressions and blocks nested more than " + std::to_string(kMaxNesting) + " levels deep");
      }
    }
    ~Nest() { --p_.nest_; }
    const Status& status() const { return status_; }

   private:
    Parser& p_;
    Status status_ = Status::Ok();
  };

  const Token& Cur() const { return t_[i_]; }
  const Token& Peek(size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  bool IsOp(const char* op) const { return Cur().type == Tok::kOp && Cur().text == op; }
  bool IsName(const char* n) const { return Cur().type == Tok::kName && Cur().text == n; }
  Status Expect(Tok type, const char* text, const char* what) {
    if (Cur().type != type || (text != nullptr && Cur().text != text)) {
      return SyntaxError(Cur().line, std::string("expected ") + what + (Cur().text.empty() ? "" : ", found '" + Cur().text + "'"));
    }
    ++i_;
    return Status::Ok();
  }

  // Statements until one of `ends` ({% end... %} or elif / else); the tag
  // that ended it goes to *end (its name), with the parser at its tokens.
  Result<NodePtr> Body(std::vector<std::string> ends, std::string* end) {
    auto body = std::make_shared<Node>();
    body->k = Node::K::kBody;
    end->clear();
    while (Cur().type != Tok::kEnd) {
      const Token& tk = Cur();
      if (tk.type == Tok::kText) {
        auto n = std::make_shared<Node>();
        n->k = Node::K::kText;
        n->text = tk.text;
        body->children.push_back(n);
        ++i_;
      } else if (tk.type == Tok::kVarBegin) {
        ++i_;
        auto n = std::make_shared<Node>();
        n->k = Node::K::kOutput;
        n->line = tk.line;
        PAGEKV_ASSIGN_OR_RETURN(n->expr, Expression());
        PAGEKV_RETURN_IF_ERROR(Expect(Tok::kVarEnd, nullptr, "'}}'"));
        body->children.push_back(n);
      } else if (tk.type == Tok::kBlockBegin) {
        const Token& name = Peek();
        if (name.type != Tok::kName) return SyntaxError(name.line, "expected a statement name after {%");
        if (std::find(ends.begin(), ends.end(), name.text) != ends.end()) {
          *end = name.text;
          i_ += 2;  // {% name: the caller reads the rest of the tag
          return body;
        }
        i_ += 2;
        PAGEKV_ASSIGN_OR_RETURN(NodePtr n, Statement(name));
        body->children.push_back(n);
      } else {
        return SyntaxError(tk.line, "unexpected '" + tk.text + "'");
      }
    }
    if (!ends.empty()) return SyntaxError(Cur().line, "the template ends inside a block: expected {% " + ends.back() + " %}");
    return body;
  }

  Result<NodePtr> Statement(const Token& name) {
    Nest nest(*this, name.line);
    PAGEKV_RETURN_IF_ERROR(nest.status());
    auto n = std::make_shared<Node>();
    n->line = name.line;
    const std::string& s = name.text;
    std::string end;
    if (s == "if") {
      n->k = Node::K::kIf;
      PAGEKV_ASSIGN_OR_RETURN(ExprPtr cond, Expression());
      PAGEKV_RETURN_IF_ERROR(Expect(Tok::kBlockEnd, nullptr, "'%}'"));
      while (true) {
        PAGEKV_ASSIGN_OR_RETURN(NodePtr body, Body({"elif", "else", "endif"}, &end));
        n->branches.emplace_back(cond, body);
        if (end == "elif") {
          PAGEKV_ASSIGN_OR_RETURN(cond, Expression());
          PAGEKV_RETURN_IF_ERROR(Expect(Tok::kBlockEnd, nullptr, "'%}'"));
          continue;
        }
        if (end == "else") {
          PAGEKV_RETURN_IF_ERROR(Expect(Tok::kBlockEnd, nullptr, "'%}'"));
          PAGEKV_ASSIGN_OR_RETURN(n->else_body, Body({"endif"}, &end));
        }
        break;
      }
      return EndTag(n);
    }
    if (s == "for") {
      n->k = Node::K::kFor;
      do {
        if (Cur().type != Tok::kName) return SyntaxError(Cur().line, "expected a loop variable name after 'for'");
        n->targets.push_back(Cur().text);
        ++i_;
      } while (IsOp(",") && (++i_, true));
      PAGEKV_RETURN_IF_ERROR(Expect(Tok::kName, "in", "'in'"));
      PAGEKV_ASSIGN_OR_RETURN(n->expr, OrExpr(/*no_cond=*/true));
      if (IsName("if")) {
        ++i_;
        PAGEKV_ASSIGN_OR_RETURN(n->expr2, OrExpr(true));
      }
      if (IsName("recursive")) return SyntaxError(Cur().line, "recursive loops are not supported");
      PAGEKV_RETURN_IF_ERROR(Expect(Tok::kBlockEnd, nullptr, "'%}'"));
      PAGEKV_ASSIGN_OR_RETURN(n->body, Body({"else", "endfor"}, &end));
      if (end == "else") {
        PAGEKV_RETURN_IF_ERROR(Expect(Tok::kBlockEnd, nullptr, "'%}'"));
        PAGEKV_ASSIGN_OR_RETURN(n->else_body, Body({"endfor"}, &end));
      }
      return EndTag(n);
    }
    if (s == "set") {
      if (Cur().type != Tok::kName) return SyntaxError(Cur().line, "expected a name after 'set'");
      if (Peek().type == Tok::kOp && Peek().text == ".") {
        n->k = Node::K::kSetAttr;
        auto obj = std::make_shared<Expr>();
        obj->k = Expr::K::kName;
        obj->name = Cur().text;
        n->expr2 = obj;
        i_ += 2;
        if (Cur().type != Tok::kName) return SyntaxError(Cur().line, "expected an attribute name after '.'");
        n->text = Cur().text;
        ++i_;
        PAGEKV_RETURN_IF_ERROR(Expect(Tok::kOp, "=", "'='"));
        PAGEKV_ASSIGN_OR_RETURN(n->expr, Expression());
        return EndTag(n);
      }
      do {
        if (Cur().type != Tok::kName) return SyntaxError(Cur().line, "expected a name to set");
        n->targets.push_back(Cur().text);
        ++i_;
      } while (IsOp(",") && (++i_, true));
      if (Cur().type == Tok::kBlockEnd && n->targets.size() == 1) {  // {% set x %}...{% endset %}
        ++i_;
        n->k = Node::K::kSetBlock;
        n->text = n->targets[0];
        PAGEKV_ASSIGN_OR_RETURN(n->body, Body({"endset"}, &end));
        PAGEKV_RETURN_IF_ERROR(Expect(Tok::kBlockEnd, nullptr, "'%}'"));
        return n;
      }
      n->k = Node::K::kSet;
      PAGEKV_RETURN_IF_ERROR(Expect(Tok::kOp, "=", "'='"));
      PAGEKV_ASSIGN_OR_RETURN(n->expr, Expression());
      return EndTag(n);
    }
    if (s == "macro") {
      n->k = Node::K::kMacro;
      if (Cur().type != Tok::kName) return SyntaxError(Cur().line, "expected a macro name");
      n->text = Cur().text;
      ++i_;
      PAGEKV_RETURN_IF_ERROR(Expect(Tok::kOp, "(", "'('"));
      while (!IsOp(")")) {
        if (Cur().type != Tok::kName) return SyntaxError(Cur().line, "expected a macro parameter name");
        std::string p = Cur().text;
        ++i_;
        ExprPtr def;
        if (IsOp("=")) {
          ++i_;
          PAGEKV_ASSIGN_OR_RETURN(def, Expression());
        }
        n->params.emplace_back(std::move(p), def);
        if (!IsOp(")")) PAGEKV_RETURN_IF_ERROR(Expect(Tok::kOp, ",", "',' or ')'"));
      }
      ++i_;
      PAGEKV_RETURN_IF_ERROR(Expect(Tok::kBlockEnd, nullptr, "'%}'"));
      PAGEKV_ASSIGN_OR_RETURN(n->body, Body({"endmacro"}, &end));
      return EndTag(n);
    }
    if (s == "filter") {
      n->k = Node::K::kFilterBlock;
      PAGEKV_ASSIGN_OR_RETURN(n->expr2, FilterCall(nullptr));
      PAGEKV_RETURN_IF_ERROR(Expect(Tok::kBlockEnd, nullptr, "'%}'"));
      PAGEKV_ASSIGN_OR_RETURN(n->body, Body({"endfilter"}, &end));
      return EndTag(n);
    }
    if (s == "generation") {  // transformers' marker around assistant text: rendered as is
      PAGEKV_RETURN_IF_ERROR(Expect(Tok::kBlockEnd, nullptr, "'%}'"));
      PAGEKV_ASSIGN_OR_RETURN(NodePtr body, Body({"endgeneration"}, &end));
      PAGEKV_RETURN_IF_ERROR(Expect(Tok::kBlockEnd, nullptr, "'%}'"));
      return body;
    }
    if (s == "break" || s == "continue") {
      n->k = s == "break" ? Node::K::kBreak : Node::K::kContinue;
      PAGEKV_RETURN_IF_ERROR(Expect(Tok::kBlockEnd, nullptr, "'%}'"));
      return n;
    }
    return SyntaxError(name.line, "the statement {% " + s + " %} is not supported by PageKV's chat-template renderer"
                                  " (it renders if, for, set, macro, filter, raw, break and continue)");
  }

  Result<NodePtr> EndTag(NodePtr n) {
    PAGEKV_RETURN_IF_ERROR(Expect(Tok::kBlockEnd, nullptr, "'%}'"));
    return n;
  }

  // The node, its depth set. Past kMaxExprDepth the first such error is
  // kept (Run returns it) and a leaf stands in, so that nothing deeper is
  // ever built; the parse goes on, in linear time, to the end.
  ExprPtr Make(Expr e) {
    uint32_t below = 0;
    for (const ExprPtr& a : e.args) below = std::max(below, a ? a->depth : 0);
    for (const auto& kv : e.kwargs) below = std::max(below, kv.second ? kv.second->depth : 0);
    e.depth = below + 1;
    if (e.depth > kMaxExprDepth) {
      if (too_deep_.ok()) {
        too_deep_ = SyntaxError(e.line > 0 ? e.line : Cur().line,
                                "an expression nested more than " + std::to_string(kMaxExprDepth) + " levels deep");
      }
      Expr leaf{Expr::K::kLiteral};
      leaf.line = e.line;
      return std::make_shared<const Expr>(std::move(leaf));
    }
    return std::make_shared<const Expr>(std::move(e));
  }

  Result<ExprPtr> Expression() {
    Nest nest(*this, Cur().line);
    PAGEKV_RETURN_IF_ERROR(nest.status());
    return OrExpr(false);
  }

  // a if b else c (unless no_cond: a for loop's iterable and filter).
  Result<ExprPtr> OrExpr(bool no_cond) {
    PAGEKV_ASSIGN_OR_RETURN(ExprPtr e, Or());
    if (no_cond) return e;
    while (IsName("if")) {
      const int line = Cur().line;
      ++i_;
      PAGEKV_ASSIGN_OR_RETURN(ExprPtr cond, Or());
      Expr c{Expr::K::kCond};
      c.line = line;
      c.args = {cond, e};
      if (IsName("else")) {
        Nest nest(*this, Cur().line);
        PAGEKV_RETURN_IF_ERROR(nest.status());
        ++i_;
        PAGEKV_ASSIGN_OR_RETURN(ExprPtr other, OrExpr(false));
        c.args.push_back(other);
      }
      e = Make(std::move(c));
    }
    return e;
  }

  Result<ExprPtr> Or() {
    PAGEKV_ASSIGN_OR_RETURN(ExprPtr e, And());
    while (IsName("or")) {
      ++i_;
      PAGEKV_ASSIGN_OR_RETURN(ExprPtr r, And());
      Expr x{Expr::K::kOr};
      x.args = {e, r};
      e = Make(std::move(x));
    }
    return e;
  }

  Result<ExprPtr> And() {
    PAGEKV_ASSIGN_OR_RETURN(ExprPtr e, Not());
    while (IsName("and")) {
      ++i_;
      PAGEKV_ASSIGN_OR_RETURN(ExprPtr r, Not());
      Expr x{Expr::K::kAnd};
      x.args = {e, r};
      e = Make(std::move(x));
    }
    return e;
  }

  Result<ExprPtr> Not() {
    if (IsName("not")) {
      Nest nest(*this, Cur().line);
      PAGEKV_RETURN_IF_ERROR(nest.status());
      ++i_;
      PAGEKV_ASSIGN_OR_RETURN(ExprPtr e, Not());
      Expr x{Expr::K::kNot};
      x.args = {e};
      return Make(std::move(x));
    }
    return Compare();
  }

  Result<ExprPtr> Compare() {
    PAGEKV_ASSIGN_OR_RETURN(ExprPtr e, Math1());
    Expr c{Expr::K::kCompare};
    c.line = Cur().line;
    c.args = {e};
    while (true) {
      std::string op;
      if (Cur().type == Tok::kOp && (Cur().text == "==" || Cur().text == "!=" || Cur().text == "<" || Cur().text == ">" ||
                                     Cur().text == "<=" || Cur().text == ">=")) {
        op = Cur().text;
        ++i_;
      } else if (IsName("in")) {
        op = "in";
        ++i_;
      } else if (IsName("not") && Peek().type == Tok::kName && Peek().text == "in") {
        op = "not in";
        i_ += 2;
      } else {
        break;
      }
      PAGEKV_ASSIGN_OR_RETURN(ExprPtr r, Math1());
      c.ops.push_back(op);
      c.args.push_back(r);
    }
    if (c.ops.empty()) return e;
    return Make(std::move(c));
  }

  Result<ExprPtr> Binary(Result<ExprPtr> (Parser::*next)(), std::initializer_list<const char*> ops) {
    PAGEKV_ASSIGN_OR_RETURN(ExprPtr e, (this->*next)());
    while (Cur().type == Tok::kOp) {
      const char* found = nullptr;
      for (const char* op : ops) {
        if (Cur().text == op) found = op;
      }
      if (found == nullptr) break;
      const int line = Cur().line;
      ++i_;
      PAGEKV_ASSIGN_OR_RETURN(ExprPtr r, (this->*next)());
      Expr x{Expr::K::kBinary};
      x.line = line;
      x.name = found;
      x.args = {e, r};
      e = Make(std::move(x));
    }
    return e;
  }
  Result<ExprPtr> Math1() { return Binary(&Parser::Concat, {"+", "-"}); }
  Result<ExprPtr> Concat() { return Binary(&Parser::Math2, {"~"}); }
  Result<ExprPtr> Math2() { return Binary(&Parser::Pow, {"*", "/", "//", "%"}); }
  Result<ExprPtr> Pow() { return Binary(&Parser::Unary, {"**"}); }

  Result<ExprPtr> Unary() {
    if (IsOp("-") || IsOp("+")) {
      Nest nest(*this, Cur().line);
      PAGEKV_RETURN_IF_ERROR(nest.status());
      const bool neg = IsOp("-");
      ++i_;
      PAGEKV_ASSIGN_OR_RETURN(ExprPtr e, Unary());
      Expr x{neg ? Expr::K::kNeg : Expr::K::kPos};
      x.args = {e};
      return Make(std::move(x));
    }
    PAGEKV_ASSIGN_OR_RETURN(ExprPtr e, Primary());
    PAGEKV_ASSIGN_OR_RETURN(e, Postfix(e));
    // Filters and tests, each possibly followed by more postfix operators.
    while (true) {
      if (IsOp("|")) {
        ++i_;
        PAGEKV_ASSIGN_OR_RETURN(e, FilterCall(e));
        PAGEKV_ASSIGN_OR_RETURN(e, Postfix(e));
      } else if (IsName("is")) {
        const int line = Cur().line;
        ++i_;
        Expr t{Expr::K::kTest};
        t.line = line;
        if (IsName("not")) {
          t.negated = true;
          ++i_;
        }
        if (Cur().type == Tok::kName) {
          t.name = Cur().text;
        } else if (IsOp("==") || IsOp("!=") || IsOp("<") || IsOp(">") || IsOp("<=") || IsOp(">=")) {
          t.name = Cur().text;
        } else {
          return SyntaxError(Cur().line, "expected a test name after 'is'");
        }
        ++i_;
        t.args = {e};
        if (IsOp("(")) {
          PAGEKV_RETURN_IF_ERROR(Args(&t));
        } else if (Cur().type == Tok::kString || Cur().type == Tok::kInt || Cur().type == Tok::kFloat ||
                   (Cur().type == Tok::kName && Cur().text != "and" && Cur().text != "or" && Cur().text != "else" &&
                    Cur().text != "if" && Cur().text != "not" && Cur().text != "in")) {
          PAGEKV_ASSIGN_OR_RETURN(ExprPtr arg, Primary());  // `is sameas false`, `is divisibleby 3`
          PAGEKV_ASSIGN_OR_RETURN(arg, Postfix(arg));
          t.args.push_back(arg);
        }
        e = Make(std::move(t));
      } else {
        return e;
      }
    }
  }

  // A filter name and its arguments, applied to `input` (null in a filter block).
  Result<ExprPtr> FilterCall(ExprPtr input) {
    if (Cur().type != Tok::kName) return SyntaxError(Cur().line, "expected a filter name after '|'");
    Expr f{Expr::K::kFilter};
    f.line = Cur().line;
    f.name = Cur().text;
    ++i_;
    while (IsOp(".") && Peek().type == Tok::kName) {  // dotted filter names
      f.name += "." + Peek().text;
      i_ += 2;
    }
    if (input) {
      f.args.push_back(input);
      f.has_input = true;
    }
    if (IsOp("(")) PAGEKV_RETURN_IF_ERROR(Args(&f));
    return Make(std::move(f));
  }

  // (a, b, k=v) into e->args (after what it holds) and e->kwargs.
  Status Args(Expr* e) {
    PAGEKV_RETURN_IF_ERROR(Expect(Tok::kOp, "(", "'('"));
    while (!IsOp(")")) {
      if (Cur().type == Tok::kName && Peek().type == Tok::kOp && Peek().text == "=") {
        std::string k = Cur().text;
        i_ += 2;
        PAGEKV_ASSIGN_OR_RETURN(ExprPtr v, Expression());
        e->kwargs.emplace_back(std::move(k), v);
      } else {
        if (IsOp("*")) return SyntaxError(Cur().line, "*args in a call are not supported");
        PAGEKV_ASSIGN_OR_RETURN(ExprPtr v, Expression());
        e->args.push_back(v);
      }
      if (!IsOp(")")) PAGEKV_RETURN_IF_ERROR(Expect(Tok::kOp, ",", "',' or ')'"));
    }
    ++i_;
    return Status::Ok();
  }

  Result<ExprPtr> Postfix(ExprPtr e) {
    while (true) {
      if (IsOp(".")) {
        ++i_;
        Expr a{Expr::K::kAttr};
        a.line = Cur().line;
        if (Cur().type == Tok::kName) {
          a.name = Cur().text;
        } else if (Cur().type == Tok::kInt) {  // x.0 is x[0]
          a.k = Expr::K::kItem;
          Expr lit{Expr::K::kLiteral};
          errno = 0;
          const long long v = std::strtoll(Cur().text.c_str(), nullptr, 10);
          if (errno != 0) return SyntaxError(Cur().line, "the index " + Cur().text + " is too large");
          lit.literal = Value(static_cast<int64_t>(v));
          a.args = {e, Make(std::move(lit))};
          ++i_;
          e = Make(std::move(a));
          continue;
        } else {
          return SyntaxError(Cur().line, "expected an attribute name after '.'");
        }
        ++i_;
        a.args = {e};
        e = Make(std::move(a));
      } else if (IsOp("[")) {
        const int line = Cur().line;
        ++i_;
        ExprPtr parts[3];
        bool slice = false;
        Expr s{Expr::K::kSlice};
        for (int p = 0; p < 3; ++p) {
          if (!IsOp(":") && !IsOp("]")) {
            PAGEKV_ASSIGN_OR_RETURN(parts[p], Expression());
            s.has_slice[p] = true;
          }
          if (IsOp(":") && p < 2) {
            slice = true;
            ++i_;
          } else {
            break;
          }
        }
        PAGEKV_RETURN_IF_ERROR(Expect(Tok::kOp, "]", "']'"));
        if (!slice) {
          if (!parts[0]) return SyntaxError(line, "an empty subscript []");
          Expr it{Expr::K::kItem};
          it.line = line;
          it.args = {e, parts[0]};
          e = Make(std::move(it));
        } else {
          s.line = line;
          s.args = {e, parts[0], parts[1], parts[2]};
          e = Make(std::move(s));
        }
      } else if (IsOp("(")) {
        Expr c{Expr::K::kCall};
        c.line = Cur().line;
        c.args = {e};
        PAGEKV_RETURN_IF_ERROR(Args(&c));
        e = Make(std::move(c));
      } else {
        return e;
      }
    }
  }

  Result<ExprPtr> Primary() {
    const Token& tk = Cur();
    Expr e{Expr::K::kLiteral};
    e.line = tk.line;
    switch (tk.type) {
      case Tok::kName: {
        ++i_;
        const std::string& n = tk.text;
        if (n == "true" || n == "True") e.literal = Value(true);
        else if (n == "false" || n == "False") e.literal = Value(false);
        else if (n == "none" || n == "None") e.literal = Value::None();
        else {
          e.k = Expr::K::kName;
          e.name = n;
        }
        return Make(std::move(e));
      }
      case Tok::kString: {
        std::string s;
        while (Cur().type == Tok::kString) {  // adjacent strings join
          s += Cur().text;
          ++i_;
        }
        e.literal = Value(std::move(s));
        return Make(std::move(e));
      }
      case Tok::kInt: {
        ++i_;
        errno = 0;
        const long long v = std::strtoll(tk.text.c_str(), nullptr, 10);
        if (errno != 0) return SyntaxError(tk.line, "the integer " + tk.text + " is too large");
        e.literal = Value(static_cast<int64_t>(v));
        return Make(std::move(e));
      }
      case Tok::kFloat:
        ++i_;
        e.literal = Value(std::strtod(tk.text.c_str(), nullptr));
        return Make(std::move(e));
      case Tok::kOp:
        if (tk.text == "(") {
          ++i_;
          if (IsOp(")")) {
            ++i_;
            e.k = Expr::K::kTuple;
            return Make(std::move(e));
          }
          PAGEKV_ASSIGN_OR_RETURN(ExprPtr first, Expression());
          if (!IsOp(",")) {
            PAGEKV_RETURN_IF_ERROR(Expect(Tok::kOp, ")", "')'"));
            return first;
          }
          e.k = Expr::K::kTuple;
          e.args.push_back(first);
          while (IsOp(",")) {
            ++i_;
            if (IsOp(")")) break;
            PAGEKV_ASSIGN_OR_RETURN(ExprPtr x, Expression());
            e.args.push_back(x);
          }
          PAGEKV_RETURN_IF_ERROR(Expect(Tok::kOp, ")", "')'"));
          return Make(std::move(e));
        }
        if (tk.text == "[") {
          ++i_;
          e.k = Expr::K::kList;
          while (!IsOp("]")) {
            PAGEKV_ASSIGN_OR_RETURN(ExprPtr x, Expression());
            e.args.push_back(x);
            if (!IsOp("]")) PAGEKV_RETURN_IF_ERROR(Expect(Tok::kOp, ",", "',' or ']'"));
          }
          ++i_;
          return Make(std::move(e));
        }
        if (tk.text == "{") {
          ++i_;
          e.k = Expr::K::kDict;
          while (!IsOp("}")) {
            PAGEKV_ASSIGN_OR_RETURN(ExprPtr k, Expression());
            PAGEKV_RETURN_IF_ERROR(Expect(Tok::kOp, ":", "':'"));
            PAGEKV_ASSIGN_OR_RETURN(ExprPtr v, Expression());
            e.args.push_back(k);
            e.args.push_back(v);
            if (!IsOp("}")) PAGEKV_RETURN_IF_ERROR(Expect(Tok::kOp, ",", "',' or '}'"));
          }
          ++i_;
          return Make(std::move(e));
        }
        return SyntaxError(tk.line, "unexpected '" + tk.text + "' in an expression");
      default:
        return SyntaxError(tk.line, "expected an expression");
    }
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int nest_ = 0;
  Status too_deep_ = Status::Ok();
};

}  // namespace

Result<Template> Template::Parse(std::string_view source, const Options& options) {
  PAGEKV_ASSIGN_OR_RETURN(std::vector<Token> tokens, Lex(source, options));
  Parser parser(std::move(tokens));
  PAGEKV_ASSIGN_OR_RETURN(NodePtr root, parser.Run());
  Template t;
  t.root_ = std::move(root);
  return t;
}

}  // namespace pagekv::jinja
