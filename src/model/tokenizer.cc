#include "model/tokenizer.h"

#include "base/regular_file.h"
#include "base/utf8.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <queue>

namespace pagekv {
namespace {

constexpr uint8_t kTypeNormal = 1, kTypeControl = 3, kTypeUserDefined = 4;

// The length of the valid UTF-8 character at s[i] (1..4), or 0 when the
// bytes there are not one (overlong forms, surrogates and code points past
// U+10FFFF are invalid).
size_t Utf8Length(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  size_t n;
  uint32_t cp;
  if ((c & 0xE0) == 0xC0) {
    n = 2;
    cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3;
    cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b(k) & 0x3F);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

std::string SpacesFromSentencePiece(const std::string& piece) {
  static const std::string kSpace = "\xE2\x96\x81";  // U+2581
  std::string out;
  for (size_t i = 0; i < piece.size();) {
    if (piece.compare(i, kSpace.size(), kSpace) == 0) {
      out += ' ';
      i += kSpace.size();
    } else {
      out += piece[i++];
    }
  }
  return out;
}

// "<0x41>" -> 0x41, or -1.
int ByteOfPiece(const std::string& p) {
  if (p.size() != 6 || p.compare(0, 3, "<0x") != 0 || p[5] != '>') return -1;
  unsigned v = 0;
  if (std::sscanf(p.c_str() + 3, "%2x", &v) != 1) return -1;
  return static_cast<int>(v);
}

// GPT-2's byte-to-character mapping: printable Latin-1 bytes stand for
// themselves, the other 68 bytes for U+0100 onwards, in byte order.
struct ByteMap {
  uint32_t to_cp[256];
  int16_t from_cp[324];  // code point -> byte, -1 for none
  ByteMap() {
    std::fill(std::begin(from_cp), std::end(from_cp), int16_t{-1});
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_cp[b] = printable ? b : next++;
      from_cp[to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};
const ByteMap& Bytes() {
  static const ByteMap m;
  return m;
}

// The pre-tokenizers by tokenizer.ggml.pre: stages of regular expressions;
// each stage splits every piece into its matches and the text between them
// (Hugging Face's "isolated" split). The expressions are those of the
// models' own tokenizer definitions.
constexpr const char* kGpt2Regex =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
constexpr const char* kLlama3Regex =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}|"
    " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kQwen2Regex =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"
    " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kDigitRegex = "\\p{N}";

std::optional<std::vector<const char*>> PreTokenizerStages(const std::string& pre) {
  if (pre.empty() || pre == "default" || pre == "gpt2" || pre == "gpt-2") return std::vector<const char*>{kGpt2Regex};
  if (pre == "smollm" || pre == "starcoder" || pre == "refact" || pre == "codeshell") {
    return std::vector<const char*>{kDigitRegex, kGpt2Regex};  // each digit alone, then GPT-2's split
  }
  if (pre == "llama-bpe" || pre == "llama3" || pre == "smaug-bpe") return std::vector<const char*>{kLlama3Regex};
  if (pre == "qwen2") return std::vector<const char*>{kQwen2Regex};
  return std::nullopt;
}

}  // namespace

struct Tokenizer::Bpe {
  struct Merge {
    int32_t rank;
    int32_t merged;
  };
  std::unordered_map<uint64_t, Merge> merges;  // (left id << 32 | right id) -> rank, result
  int32_t byte_token[256];                     // the single-character token of each byte, or -1
  std::vector<pcre2_code*> stages;

  ~Bpe() {
    for (pcre2_code* c : stages) pcre2_code_free(c);
  }

  static uint64_t Key(int32_t a, int32_t b) { return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b); }

  // Splits `text` (valid UTF-8) by every stage in turn.
  std::vector<std::string_view> Split(std::string_view text) const {
    std::vector<std::string_view> pieces{text};
    for (pcre2_code* re : stages) {
      std::vector<std::string_view> next;
      pcre2_match_data* md = pcre2_match_data_create_from_pattern(re, nullptr);
      for (std::string_view p : pieces) {
        size_t at = 0;
        while (at < p.size()) {
          const int rc = pcre2_match(re, reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(), at, PCRE2_NO_UTF_CHECK, md, nullptr);
          if (rc < 0) break;
          const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
          if (ov[0] > at) next.push_back(p.substr(at, ov[0] - at));
          if (ov[1] == ov[0]) {  // an empty match: step over one character
            const size_t n = std::max<size_t>(1, Utf8Length(p, ov[0]));
            next.push_back(p.substr(ov[0], n));
            at = ov[0] + n;
            continue;
          }
          next.push_back(p.substr(ov[0], ov[1] - ov[0]));
          at = ov[1];
        }
        if (at < p.size()) next.push_back(p.substr(at));
      }
      pcre2_match_data_free(md);
      pieces = std::move(next);
    }
    return pieces;
  }
};

void Tokenizer::Index() {
  ids_.clear();
  ids_.reserve(pieces_.size());
  for (int& b : byte_ids_) b = -1;
  specials_.clear();
  max_piece_bytes_ = 1;
  for (size_t i = 0; i < pieces_.size(); ++i) {
    max_piece_bytes_ = std::max(max_piece_bytes_, static_cast<int32_t>(std::min<size_t>(pieces_[i].size(), 1 << 20)));
    ids_.emplace(pieces_[i], static_cast<int32_t>(i));  // first occurrence wins, as run.c's sorted lookup
    const int byte = kind_ == Kind::kSentencePiece ? ByteOfPiece(pieces_[i]) : -1;
    if (byte >= 0 && byte_ids_[byte] < 0) byte_ids_[byte] = static_cast<int32_t>(i);
    const uint8_t type = i < types_.size() ? types_[i] : kTypeNormal;
    if ((type == kTypeControl || type == kTypeUserDefined) && !pieces_[i].empty()) specials_.push_back(static_cast<int32_t>(i));
  }
  // Longest first, so "<|im_start|>" is never cut as "<|im" + ...
  std::stable_sort(specials_.begin(), specials_.end(), [&](int32_t a, int32_t b) {
    return pieces_[static_cast<size_t>(a)].size() > pieces_[static_cast<size_t>(b)].size();
  });
  specials_by_byte_.assign(256, {});
  for (int32_t sp : specials_) {
    specials_by_byte_[static_cast<unsigned char>(pieces_[static_cast<size_t>(sp)][0])].push_back(sp);
  }
}

std::optional<int32_t> Tokenizer::TokenId(std::string_view piece) const {
  const int32_t id = Lookup(piece);
  if (id < 0) return std::nullopt;
  return id;
}

bool Tokenizer::IsControl(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return false;
  if (static_cast<size_t>(id) < types_.size()) return types_[static_cast<size_t>(id)] == kTypeControl;
  return id == bos_id_ || id == eos_id_;
}

Result<Tokenizer> Tokenizer::FromPieces(std::vector<std::string> pieces, std::vector<float> scores, int32_t bos_id,
                                        int32_t eos_id) {
  if (pieces.empty() || pieces.size() != scores.size()) {
    return DataLossError("tokenizer: " + std::to_string(pieces.size()) + " pieces but " +
                         std::to_string(scores.size()) + " scores");
  }
  const auto n = static_cast<int32_t>(pieces.size());
  if (bos_id < 0 || bos_id >= n || eos_id < 0 || eos_id >= n) {
    return DataLossError("tokenizer: BOS/EOS id outside the vocabulary of " + std::to_string(n));
  }
  Tokenizer t;
  t.pieces_ = std::move(pieces);
  t.scores_ = std::move(scores);
  t.bos_id_ = bos_id;
  t.eos_id_ = eos_id;
  t.Index();
  return t;
}

Result<Tokenizer> Tokenizer::FromGguf(const GgufFile& file) {
  const GgufValue* tokens = file.Find("tokenizer.ggml.tokens");
  const GgufValue* scores = file.Find("tokenizer.ggml.scores");
  if (tokens == nullptr || !tokens->is_array() || tokens->element_type != GgufType::kString) {
    return DataLossError("model has no tokenizer.ggml.tokens string array");
  }
  std::string model = "llama";
  if (file.Find("tokenizer.ggml.model") != nullptr) {
    PAGEKV_ASSIGN_OR_RETURN(model, file.GetString("tokenizer.ggml.model"));
  }
  if (model != "llama" && model != "gpt2") {
    return UnimplementedError("tokenizer.ggml.model = '" + model +
                              "' is not supported: PageKV reads 'llama' (SentencePiece) and 'gpt2' (byte-level BPE)");
  }
  std::vector<uint8_t> types;
  if (const GgufValue* tt = file.Find("tokenizer.ggml.token_type"); tt != nullptr) {
    if (!tt->is_array() || tt->elements.size() != tokens->elements.size()) {
      return DataLossError("tokenizer.ggml.token_type must be an array as long as tokenizer.ggml.tokens");
    }
    for (const auto& e : tt->elements) {
      const int64_t v = std::holds_alternative<int64_t>(e) ? std::get<int64_t>(e)
                        : std::holds_alternative<uint64_t>(e) ? static_cast<int64_t>(std::get<uint64_t>(e)) : -1;
      if (v < 0 || v > 6) return DataLossError("tokenizer.ggml.token_type holds " + std::to_string(v) + ", not a token type (0..6)");
      types.push_back(static_cast<uint8_t>(v));
    }
  }
  auto id = [&](const char* key, int64_t fallback) {
    Result<int64_t> v = file.GetInt(key);
    return v.ok() ? *v : fallback;
  };
  auto flag = [&](const char* key, bool fallback) {
    const GgufValue* v = file.Find(key);
    return v != nullptr && std::holds_alternative<bool>(v->scalar) ? std::get<bool>(v->scalar) : fallback;
  };
  if (model == "gpt2") {
    Tokenizer t;
    t.kind_ = Kind::kByteBpe;
    for (const auto& e : tokens->elements) t.pieces_.push_back(std::get<std::string>(e));
    t.scores_.assign(t.pieces_.size(), 0.0f);
    t.types_ = std::move(types);
    const auto n = static_cast<int64_t>(t.pieces_.size());
    t.bos_id_ = static_cast<int32_t>(id("tokenizer.ggml.bos_token_id", -1));
    t.eos_id_ = static_cast<int32_t>(id("tokenizer.ggml.eos_token_id", -1));
    if (t.bos_id_ < -1 || t.bos_id_ >= n || t.eos_id_ < 0 || t.eos_id_ >= n) {
      return DataLossError("tokenizer: BOS/EOS id outside the vocabulary of " + std::to_string(n));
    }
    t.add_bos_ = flag("tokenizer.ggml.add_bos_token", false) && t.bos_id_ >= 0;
    t.add_eos_ = flag("tokenizer.ggml.add_eos_token", false);
    if (file.Find("tokenizer.ggml.pre") != nullptr) {
      PAGEKV_ASSIGN_OR_RETURN(t.pre_, file.GetString("tokenizer.ggml.pre"));
    }
    const std::optional<std::vector<const char*>> stages = PreTokenizerStages(t.pre_);
    if (!stages) {
      return UnimplementedError("tokenizer.ggml.pre = '" + t.pre_ + "' is not supported: PageKV knows gpt2 (default), "
                                "smollm, starcoder, refact, codeshell, llama-bpe, smaug-bpe and qwen2");
    }
    t.Index();
    auto bpe = std::make_shared<Bpe>();
    for (const char* pattern : *stages) {
      int err = 0;
      PCRE2_SIZE at = 0;
      pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                     &err, &at, nullptr);
      if (re == nullptr) return InternalError("tokenizer: a pre-tokenizer expression failed to compile");
      pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);  // optional: the interpreter runs the same expression
      bpe->stages.push_back(re);
    }
    const ByteMap& bm = Bytes();
    for (int b = 0; b < 256; ++b) {
      std::string ch;
      AppendUtf8(bm.to_cp[b], ch);
      bpe->byte_token[b] = t.Lookup(ch);
    }
    const GgufValue* merges = file.Find("tokenizer.ggml.merges");
    if (merges == nullptr || !merges->is_array() || merges->element_type != GgufType::kString) {
      return DataLossError("a byte-level BPE tokenizer needs tokenizer.ggml.merges (a string array)");
    }
    bpe->merges.reserve(merges->elements.size());
    for (size_t r = 0; r < merges->elements.size(); ++r) {
      const std::string& m = std::get<std::string>(merges->elements[r]);
      const size_t space = m.find(' ', 1);
      if (space == std::string::npos) return DataLossError("tokenizer merge " + std::to_string(r) + " '" + m + "' is not 'A B'");
      const int32_t a = t.Lookup(std::string_view(m).substr(0, space)), b = t.Lookup(std::string_view(m).substr(space + 1));
      const int32_t merged = t.Lookup(m.substr(0, space) + m.substr(space + 1));
      if (a < 0 || b < 0 || merged < 0) continue;  // a merge whose result is not a token can never apply
      bpe->merges.emplace(Bpe::Key(a, b), Bpe::Merge{static_cast<int32_t>(r), merged});  // the first rank wins
    }
    t.bpe_ = std::move(bpe);
    return t;
  }
  std::vector<std::string> pieces;
  pieces.reserve(tokens->elements.size());
  for (const auto& e : tokens->elements) pieces.push_back(SpacesFromSentencePiece(std::get<std::string>(e)));
  std::vector<float> sc(pieces.size(), 0.0f);
  if (scores != nullptr) {
    if (!scores->is_array() || scores->elements.size() != pieces.size() ||
        scores->element_type != GgufType::kF32) {
      return DataLossError("tokenizer.ggml.scores must be an f32 array as long as tokenizer.ggml.tokens");
    }
    for (size_t i = 0; i < sc.size(); ++i) sc[i] = static_cast<float>(std::get<double>(scores->elements[i]));
  }
  PAGEKV_ASSIGN_OR_RETURN(Tokenizer t, FromPieces(std::move(pieces), std::move(sc),
                                                   static_cast<int32_t>(id("tokenizer.ggml.bos_token_id", 1)),
                                                   static_cast<int32_t>(id("tokenizer.ggml.eos_token_id", 2))));
  t.types_ = std::move(types);
  t.add_bos_ = flag("tokenizer.ggml.add_bos_token", true);
  t.add_eos_ = flag("tokenizer.ggml.add_eos_token", false);
  t.add_space_prefix_ = flag("tokenizer.ggml.add_space_prefix", true);
  t.Index();
  return t;
}

Result<Tokenizer> Tokenizer::FromLlama2c(const std::string& path, int32_t vocab_size) {
  // A llama2.c tokenizer of vocab_size pieces is far below 1 GiB.
  PAGEKV_ASSIGN_OR_RETURN(RegularFile rf, OpenRegularFile(path, "tokenizer", int64_t{1} << 30));
  std::string bytes(static_cast<size_t>(rf.size), '\0');
  size_t got = 0;
  for (ssize_t n; got < bytes.size() && (n = ::read(rf.fd, bytes.data() + got, bytes.size() - got)) > 0;) {
    got += static_cast<size_t>(n);
  }
  ::close(rf.fd);
  bytes.resize(got);
  size_t pos = 0;
  auto read = [&](void* out, size_t n) {
    if (bytes.size() - pos < n) return false;
    std::memcpy(out, bytes.data() + pos, n);
    pos += n;
    return true;
  };
  int32_t max_len = 0;
  if (vocab_size <= 0 || !read(&max_len, 4) || max_len <= 0) {
    return DataLossError("tokenizer '" + path + "': bad header (expected a llama2.c tokenizer.bin)");
  }
  std::vector<std::string> pieces;
  std::vector<float> scores;
  for (int32_t i = 0; i < vocab_size; ++i) {
    float score = 0;
    int32_t len = 0;
    if (!read(&score, 4) || !read(&len, 4) || len < 0 || len > max_len ||
        static_cast<size_t>(len) > bytes.size() - pos) {
      return DataLossError("tokenizer '" + path + "': truncated or corrupt at piece " + std::to_string(i) + " of " +
                           std::to_string(vocab_size));
    }
    pieces.emplace_back(bytes.data() + pos, static_cast<size_t>(len));
    pos += static_cast<size_t>(len);
    scores.push_back(score);
  }
  return FromPieces(std::move(pieces), std::move(scores), 1, 2);
}

int32_t Tokenizer::Lookup(std::string_view s) const {
  auto it = ids_.find(std::string(s));
  return it == ids_.end() ? -1 : it->second;
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool bos, bool eos, bool parse_special) const {
  std::vector<int32_t> out;
  if (bos && bos_id_ >= 0) out.push_back(bos_id_);
  const std::string clean = kind_ == Kind::kByteBpe ? SanitizeUtf8(text) : std::string();
  if (kind_ == Kind::kByteBpe) text = clean;
  auto span = [&](std::string_view part) {
    if (kind_ == Kind::kByteBpe) {
      EncodeBpeSpan(part, out);
    } else {
      const std::vector<int32_t> ids = EncodeSentencePiece(part);
      out.insert(out.end(), ids.begin(), ids.end());
    }
  };
  // Special tokens cut out first; the text between them is encoded alone.
  // User-defined pieces (Gemma's "\n", runs of tabs) always are, as
  // SentencePiece, llama.cpp and Hugging Face match them; control ones only
  // when asked.
  size_t begin = 0;
  if (!specials_.empty()) {
    for (size_t i = 0; i < text.size(); ++i) {
      for (int32_t sp : specials_by_byte_[static_cast<unsigned char>(text[i])]) {
        if (!parse_special && types_[static_cast<size_t>(sp)] != kTypeUserDefined) continue;
        const std::string& p = pieces_[static_cast<size_t>(sp)];
        if (text.compare(i, p.size(), p) != 0) continue;
        if (i > begin) span(text.substr(begin, i - begin));
        out.push_back(sp);
        begin = i + p.size();
        i = begin - 1;
        break;
      }
    }
  }
  if (begin < text.size()) span(text.substr(begin));
  if (eos) out.push_back(eos_id_);
  return out;
}

void Tokenizer::EncodeBpeSpan(std::string_view text, std::vector<int32_t>& out) const {
  const Bpe& bpe = *bpe_;
  std::vector<int32_t> sym;
  std::vector<int64_t> next, prev;
  struct Candidate {
    int32_t rank;
    int64_t left;
    int32_t left_id, right_id, merged_id;
  };
  auto worse = [](const Candidate& a, const Candidate& b) { return a.rank > b.rank || (a.rank == b.rank && a.left > b.left); };
  for (std::string_view piece : bpe.Split(text)) {
    // One symbol per byte, then merges by rank (lowest first, leftmost on
    // ties) over a linked list with a heap of candidate pairs: O(n log n).
    sym.clear();
    for (char c : piece) {
      const int32_t id = bpe.byte_token[static_cast<unsigned char>(c)];
      sym.push_back(id >= 0 ? id : 0);
    }
    const size_t n = sym.size();
    next.assign(n, -1);
    prev.assign(n, -1);
    for (size_t i = 0; i < n; ++i) {
      next[i] = i + 1 < n ? static_cast<int64_t>(i + 1) : -1;
      prev[i] = static_cast<int64_t>(i) - 1;
    }
    std::vector<bool> alive(n, true);
    std::priority_queue<Candidate, std::vector<Candidate>, decltype(worse)> heap(worse);
    auto offer = [&](int64_t left) {
      if (left < 0 || next[static_cast<size_t>(left)] < 0) return;
      const int32_t a = sym[static_cast<size_t>(left)], b = sym[static_cast<size_t>(next[static_cast<size_t>(left)])];
      auto it = bpe.merges.find(Bpe::Key(a, b));
      if (it != bpe.merges.end()) heap.push({it->second.rank, left, a, b, it->second.merged});
    };
    for (size_t i = 0; i + 1 < n; ++i) offer(static_cast<int64_t>(i));
    while (!heap.empty()) {
      const Candidate c = heap.top();
      heap.pop();
      const auto l = static_cast<size_t>(c.left);
      const int64_t r = next[l];
      if (!alive[l] || r < 0 || sym[l] != c.left_id || sym[static_cast<size_t>(r)] != c.right_id) continue;
      sym[l] = c.merged_id;
      alive[static_cast<size_t>(r)] = false;
      next[l] = next[static_cast<size_t>(r)];
      if (next[l] >= 0) prev[static_cast<size_t>(next[l])] = c.left;
      offer(prev[l]);
      offer(c.left);
    }
    for (int64_t i = n > 0 ? 0 : -1; i >= 0; i = next[static_cast<size_t>(i)]) out.push_back(sym[static_cast<size_t>(i)]);
  }
}

std::vector<int32_t> Tokenizer::EncodeSentencePiece(std::string_view text) const {
  std::vector<int32_t> tokens;
  if (!text.empty() && add_space_prefix_) {
    const int32_t prefix = Lookup(" ");
    if (prefix >= 0) tokens.push_back(prefix);
  }
  // One token per UTF-8 character, or its bytes.
  for (size_t i = 0; i < text.size();) {
    size_t len = 1;
    while (len < 4 && i + len < text.size() && (static_cast<unsigned char>(text[i + len]) & 0xC0) == 0x80) ++len;
    const int32_t id = Lookup(text.substr(i, len));
    if (id >= 0) {
      tokens.push_back(id);
    } else {
      for (size_t b = 0; b < len; ++b) {
        const auto byte = static_cast<unsigned char>(text[i + b]);
        tokens.push_back(byte_ids_[byte] >= 0 ? byte_ids_[byte] : 0);  // <unk> when no byte piece exists
      }
    }
    i += len;
  }
  // Merge the best-scoring adjacent pair until none merges; among equal
  // scores the leftmost pair goes first. The symbols form a linked list and
  // the candidate pairs a heap, so this is O(n log n) rather than a rescan of
  // the whole text per merge. A heap entry is stale once either side has
  // merged (a merged piece is longer, so its id differs).
  const size_t n = tokens.size();
  std::vector<int64_t> next(n), prev(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) {
    next[i] = i + 1 < n ? static_cast<int64_t>(i + 1) : -1;
    prev[i] = static_cast<int64_t>(i) - 1;
  }
  struct Candidate {
    float score;
    int64_t left;  // node index; order of nodes = order in the text
    int32_t left_id, right_id, merged_id;
  };
  auto worse = [](const Candidate& a, const Candidate& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(worse)> heap(worse);
  std::string pair;
  auto offer = [&](int64_t left) {
    if (left < 0 || next[static_cast<size_t>(left)] < 0) return;
    const int32_t a = tokens[static_cast<size_t>(left)], b = tokens[static_cast<size_t>(next[static_cast<size_t>(left)])];
    pair = pieces_[static_cast<size_t>(a)];
    pair += pieces_[static_cast<size_t>(b)];
    const int32_t id = Lookup(pair);
    if (id >= 0) heap.push({scores_[static_cast<size_t>(id)], left, a, b, id});
  };
  for (size_t i = 0; i + 1 < n; ++i) offer(static_cast<int64_t>(i));
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    const auto l = static_cast<size_t>(c.left);
    const int64_t r = next[l];
    if (!alive[l] || r < 0 || tokens[l] != c.left_id || tokens[static_cast<size_t>(r)] != c.right_id) continue;
    tokens[l] = c.merged_id;
    alive[static_cast<size_t>(r)] = false;
    next[l] = next[static_cast<size_t>(r)];
    if (next[l] >= 0) prev[static_cast<size_t>(next[l])] = c.left;
    offer(prev[l]);
    offer(c.left);
  }
  std::vector<int32_t> merged;
  merged.reserve(n);
  for (int64_t i = n > 0 ? 0 : -1; i >= 0; i = next[static_cast<size_t>(i)]) merged.push_back(tokens[static_cast<size_t>(i)]);
  return merged;
}

std::string Tokenizer::DecodePiece(int32_t prev, int32_t token, bool specials) const {
  if (token < 0 || token >= vocab_size()) return {};
  const uint8_t type = static_cast<size_t>(token) < types_.size() ? types_[static_cast<size_t>(token)] : kTypeNormal;
  if (IsControl(token) && !specials) return {};
  if (kind_ == Kind::kByteBpe) {
    const std::string& p = pieces_[static_cast<size_t>(token)];
    if (type == kTypeControl || type == kTypeUserDefined) return p;  // written as themselves
    // Characters back to the bytes they stand for.
    std::string out;
    const ByteMap& bm = Bytes();
    for (size_t i = 0; i < p.size();) {
      const size_t len = std::max<size_t>(1, Utf8Length(p, i));
      uint32_t cp = static_cast<unsigned char>(p[i]);
      if (len > 1) {
        cp &= 0xFFu >> (len + 1);
        for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(p[i + k]) & 0x3F);
      }
      if (cp < std::size(bm.from_cp) && bm.from_cp[cp] >= 0) {
        out += static_cast<char>(bm.from_cp[cp]);
      } else {
        out.append(p, i, len);  // not a mapped byte (a malformed vocabulary): kept as it is
      }
      i += len;
    }
    return out;
  }
  std::string_view p = pieces_[static_cast<size_t>(token)];
  if (add_space_prefix_ && prev == bos_id_ && !p.empty() && p[0] == ' ') p.remove_prefix(1);
  const int byte = ByteOfPiece(std::string(p));
  if (byte >= 0) return std::string(1, static_cast<char>(byte));
  return std::string(p);
}

std::string Tokenizer::Decode(const std::vector<int32_t>& tokens, bool specials) const {
  std::string out;
  int32_t prev = -1;
  for (int32_t t : tokens) {
    if (t != bos_id_ || specials) out += DecodePiece(prev, t, specials);
    prev = t;
  }
  return out;
}

std::string SanitizeUtf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8Length(s, i);
    if (n == 0) {
      out += kReplacement;
      ++i;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

std::string Utf8Stream::Push(std::string_view bytes) {
  pending_.append(bytes);
  // Everything up to the last character that may still be growing.
  size_t keep = 0;
  for (size_t k = 1; k <= 3 && k <= pending_.size(); ++k) {
    const auto c = static_cast<unsigned char>(pending_[pending_.size() - k]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t want = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    if (want > k) keep = k;  // a lead byte whose character is not complete yet
    break;
  }
  std::string out = SanitizeUtf8(std::string_view(pending_).substr(0, pending_.size() - keep));
  pending_.erase(0, pending_.size() - keep);
  return out;
}

std::string Utf8Stream::Finish() {
  std::string out = SanitizeUtf8(pending_);
  pending_.clear();
  return out;
}

std::vector<int32_t> StopTokens(const Tokenizer& tok, const GgufFile* file) {
  std::vector<int32_t> out{tok.eos_id()};
  auto add = [&](int32_t id) {
    if (id >= 0 && id < tok.vocab_size() && std::find(out.begin(), out.end(), id) == out.end()) out.push_back(id);
  };
  static constexpr const char* kEndOfTurn[] = {"<|im_end|>", "<|eot_id|>",    "<|eom_id|>", "<end_of_turn>",
                                               "<|end|>",    "<|endoftext|>", "</s>",       "<|return|>"};
  for (const char* piece : kEndOfTurn) {
    if (std::optional<int32_t> id = tok.TokenId(piece); id && tok.IsControl(*id)) add(*id);
  }
  if (file != nullptr) {
    for (const char* key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}) {
      if (Result<int64_t> id = file->GetInt(key); id.ok()) add(static_cast<int32_t>(*id));
    }
  }
  return out;
}

}  // namespace pagekv
