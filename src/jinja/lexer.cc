// The chat-template lexer (lexer.h).
#include "jinja/lexer.h"

#include "base/utf8.h"

#include <optional>

namespace pagekv::jinja {
namespace {

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

class Lexer {
 public:
  Lexer(std::string_view src, const Options& o) : src_(src), o_(o) {
    if (!o_.keep_trailing_newline) {
      if (src_.size() >= 2 && src_.substr(src_.size() - 2) == "\r\n") {
        src_.remove_suffix(2);
      } else if (!src_.empty() && src_.back() == '\n') {
        src_.remove_suffix(1);
      }
    }
  }

  Result<std::vector<Token>> Run() {
    bool strip_next = false;  // a "-" at the end of the previous tag
    bool trim_newline = false;  // trim_blocks after a block or comment tag
    while (pos_ < src_.size()) {
      size_t start = FindTag(pos_);
      std::string text(src_.substr(pos_, start - pos_));
      if (trim_newline && !text.empty()) {
        if (text[0] == '\n') {
          text.erase(0, 1);
        } else if (text.size() >= 2 && text[0] == '\r' && text[1] == '\n') {
          text.erase(0, 2);
        }
      }
      if (strip_next) {
        size_t i = 0;
        while (i < text.size() && IsSpace(text[i])) ++i;
        text.erase(0, i);
      }
      strip_next = trim_newline = false;
      if (start >= src_.size()) {
        Emit(Tok::kText, std::move(text));
        line_ += CountLines(src_.substr(pos_));
        break;
      }
      const char kind = src_[start + 1];  // '{', '%' or '#'
      const char mod = start + 2 < src_.size() ? src_[start + 2] : '\0';
      if (mod == '-') {
        while (!text.empty() && IsSpace(text.back())) text.pop_back();
      } else if (mod != '+' && (kind == '%' || kind == '#') && o_.lstrip_blocks) {
        // Spaces and tabs from the start of the line up to the tag.
        size_t i = text.size();
        while (i > 0 && (text[i - 1] == ' ' || text[i - 1] == '\t')) --i;
        const bool line_start = i == 0 ? (start == pos_ ? AtLineStart(pos_) : AtLineStart(start - text.size()))
                                       : text[i - 1] == '\n';
        if (line_start) text.erase(i);
      }
      Emit(Tok::kText, std::move(text));
      line_ += CountLines(src_.substr(pos_, start - pos_));
      pos_ = start + 2 + ((mod == '-' || mod == '+') ? 1 : 0);
      if (kind == '#') {
        const size_t end = src_.find("#}", pos_);
        if (end == std::string::npos) return SyntaxError(line_, "a comment {# is never closed");
        strip_next = end > pos_ && src_[end - 1] == '-';
        line_ += CountLines(src_.substr(pos_, end - pos_));
        pos_ = end + 2;
        trim_newline = o_.trim_blocks && !strip_next;
        continue;
      }
      const Tok open = kind == '%' ? Tok::kBlockBegin : Tok::kVarBegin;
      Emit(open, "");
      bool minus = false;
      PAGEKV_RETURN_IF_ERROR(LexInside(kind == '%' ? '%' : '}', &minus));
      strip_next = minus;
      trim_newline = kind == '%' && o_.trim_blocks && !minus;
      if (kind == '%' && IsRawTag()) {
        PAGEKV_RETURN_IF_ERROR(LexRaw(&strip_next, &trim_newline));
      }
    }
    Emit(Tok::kEnd, "");
    return std::move(tokens_);
  }

 private:
  static int CountLines(std::string_view s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }
  bool AtLineStart(size_t at) const { return at == 0 || src_[at - 1] == '\n'; }

  size_t FindTag(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i) {
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    }
    return src_.size();
  }

  void Emit(Tok t, std::string text) {
    if (t == Tok::kText && text.empty()) return;
    tokens_.push_back({t, std::move(text), line_});
  }

  // The last tag lexed was "{% raw %}".
  bool IsRawTag() const {
    const size_t n = tokens_.size();
    return n >= 3 && tokens_[n - 1].type == Tok::kBlockEnd && tokens_[n - 2].type == Tok::kName &&
           tokens_[n - 2].text == "raw" && tokens_[n - 3].type == Tok::kBlockBegin;
  }

  // Text up to {% endraw %}, emitted as is (the raw tag's tokens dropped).
  Status LexRaw(bool* strip_next, bool* trim_newline) {
    tokens_.resize(tokens_.size() - 3);
    for (size_t i = pos_; i + 1 < src_.size(); ++i) {
      if (src_[i] != '{' || src_[i + 1] != '%') continue;
      size_t j = i + 2;
      const bool minus_open = j < src_.size() && src_[j] == '-';
      if (minus_open || (j < src_.size() && src_[j] == '+')) ++j;
      while (j < src_.size() && IsSpace(src_[j])) ++j;
      if (src_.compare(j, 6, "endraw") != 0) continue;
      j += 6;
      while (j < src_.size() && IsSpace(src_[j])) ++j;
      const bool minus_close = j < src_.size() && src_[j] == '-';
      if (minus_close) ++j;
      if (src_.compare(j, 2, "%}") != 0) continue;
      std::string text(src_.substr(pos_, i - pos_));
      if (*trim_newline && !text.empty() && text[0] == '\n') text.erase(0, 1);
      if (*strip_next) {
        size_t k = 0;
        while (k < text.size() && IsSpace(text[k])) ++k;
        text.erase(0, k);
      }
      if (minus_open) {
        while (!text.empty() && IsSpace(text.back())) text.pop_back();
      }
      line_ += CountLines(src_.substr(pos_, j + 2 - pos_));
      Emit(Tok::kText, std::move(text));
      pos_ = j + 2;
      *strip_next = minus_close;
      *trim_newline = o_.trim_blocks && !minus_close;
      return Status::Ok();
    }
    return SyntaxError(line_, "{% raw %} is never closed by {% endraw %}");
  }

  // Tokens of a tag's inside, up to its closing "%}" or "}}".
  Status LexInside(char close, bool* minus) {
    static constexpr std::string_view kOps3[] = {"//", "**", "==", "!=", "<=", ">="};
    // Open brackets: a "}}" inside a dict literal closes the dict, not the
    // tag (Jinja balances brackets the same way).
    std::string open;
    while (true) {
      while (pos_ < src_.size() && IsSpace(src_[pos_])) {
        if (src_[pos_] == '\n') ++line_;
        ++pos_;
      }
      if (pos_ >= src_.size()) return SyntaxError(line_, std::string("a tag is never closed (expected ") + close + "})");
      const char c = src_[pos_];
      // The closing delimiter, with an optional "-" before it.
      if (open.empty() && c == '-' && src_.compare(pos_ + 1, 2, std::string(1, close) + "}") == 0) {
        *minus = true;
        pos_ += 3;
        Emit(close == '%' ? Tok::kBlockEnd : Tok::kVarEnd, "");
        return Status::Ok();
      }
      if (open.empty() && c == close && pos_ + 1 < src_.size() && src_[pos_ + 1] == '}') {
        pos_ += 2;
        Emit(close == '%' ? Tok::kBlockEnd : Tok::kVarEnd, "");
        return Status::Ok();
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = pos_;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        Emit(Tok::kName, std::string(src_.substr(pos_, e - pos_)));
        pos_ = e;
        continue;
      }
      if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t e = pos_;
        bool is_float = false;
        while (e < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        if (e + 1 < src_.size() && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
          is_float = true;
          ++e;
          while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
        }
        if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
          size_t k = e + 1;
          if (k < src_.size() && (src_[k] == '+' || src_[k] == '-')) ++k;
          if (k < src_.size() && std::isdigit(static_cast<unsigned char>(src_[k]))) {
            is_float = true;
            e = k;
            while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
          }
        }
        std::string num(src_.substr(pos_, e - pos_));
        num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
        Emit(is_float ? Tok::kFloat : Tok::kInt, std::move(num));
        pos_ = e;
        continue;
      }
      if (c == '"' || c == '\'') {
        std::string s;
        PAGEKV_RETURN_IF_ERROR(LexString(c, &s));
        Emit(Tok::kString, std::move(s));
        continue;
      }
      std::string op(1, c);
      for (std::string_view o : kOps3) {
        if (src_.compare(pos_, 2, o) == 0) op = std::string(o);
      }
      if (std::string_view("()[]{}.,:|~+-*/%=<>!").find(c) == std::string_view::npos) {
        return SyntaxError(line_, std::string("unexpected character '") + c + "' in a tag");
      }
      if (op == "!") return SyntaxError(line_, "'!' is not an operator (write 'not' or '!=')");
      if (op == "(" || op == "[" || op == "{") {
        open.push_back(c);
      } else if (op == ")" || op == "]" || op == "}") {
        const char want = c == ')' ? '(' : c == ']' ? '[' : '{';
        if (open.empty() || open.back() != want) return SyntaxError(line_, std::string("unbalanced '") + c + "'");
        open.pop_back();
      }
      pos_ += op.size();
      Emit(Tok::kOp, std::move(op));
    }
  }

  // A quoted string with Python's escapes (\n \t \r \\ \' \" \xhh \uhhhh
  // \Uhhhhhhhh \a \b \f \v \0); an unknown escape keeps its backslash.
  Status LexString(char quote, std::string* out) {
    const int line = line_;
    ++pos_;
    while (pos_ < src_.size() && src_[pos_] != quote) {
      char c = src_[pos_++];
      if (c == '\n') ++line_;
      if (c != '\\' || pos_ >= src_.size()) {
        *out += c;
        continue;
      }
      const char e = src_[pos_++];
      auto hex = [&](int n) -> std::optional<uint32_t> {
        if (pos_ + static_cast<size_t>(n) > src_.size()) return std::nullopt;
        uint32_t v = 0;
        for (int i = 0; i < n; ++i) {
          const char h = src_[pos_ + static_cast<size_t>(i)];
          if (!std::isxdigit(static_cast<unsigned char>(h))) return std::nullopt;
          v = v * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
        }
        pos_ += static_cast<size_t>(n);
        return v;
      };
      switch (e) {
        case 'n': *out += '\n'; break;
        case 't': *out += '\t'; break;
        case 'r': *out += '\r'; break;
        case '\\': *out += '\\'; break;
        case '\'': *out += '\''; break;
        case '"': *out += '"'; break;
        case 'a': *out += '\a'; break;
        case 'b': *out += '\b'; break;
        case 'f': *out += '\f'; break;
        case 'v': *out += '\v'; break;
        case '0': *out += '\0'; break;
        case '\n': ++line_; break;  // a line continuation
        case 'x':
        case 'u':
        case 'U': {
          const auto v = hex(e == 'x' ? 2 : e == 'u' ? 4 : 8);
          if (!v || *v > 0x10FFFF) return SyntaxError(line_, std::string("a bad \\") + e + " escape in a string");
          AppendUtf8(*v, *out);
          break;
        }
        default:
          *out += '\\';
          *out += e;
      }
    }
    if (pos_ >= src_.size()) return SyntaxError(line, "a string is never closed");
    ++pos_;
    return Status::Ok();
  }

  std::string_view src_;
  Options o_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

}  // namespace

Result<std::vector<Token>> Lex(std::string_view source, const Options& options) {
  Lexer lexer(source, options);
  return lexer.Run();
}

}  // namespace pagekv::jinja
