#include "model/tokenizer.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <queue>

namespace pagekv {
namespace {

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

}  // namespace

void Tokenizer::Index() {
  ids_.clear();
  ids_.reserve(pieces_.size());
  for (int& b : byte_ids_) b = -1;
  for (size_t i = 0; i < pieces_.size(); ++i) {
    ids_.emplace(pieces_[i], static_cast<int32_t>(i));  // first occurrence wins, as run.c's sorted lookup
    const int byte = ByteOfPiece(pieces_[i]);
    if (byte >= 0 && byte_ids_[byte] < 0) byte_ids_[byte] = static_cast<int32_t>(i);
  }
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
  auto id = [&](const char* key, int64_t fallback) {
    Result<int64_t> v = file.GetInt(key);
    return v.ok() ? *v : fallback;
  };
  return FromPieces(std::move(pieces), std::move(sc), static_cast<int32_t>(id("tokenizer.ggml.bos_token_id", 1)),
                    static_cast<int32_t>(id("tokenizer.ggml.eos_token_id", 2)));
}

Result<Tokenizer> Tokenizer::FromLlama2c(const std::string& path, int32_t vocab_size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError("cannot open tokenizer '" + path + "'");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
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

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool bos, bool eos) const {
  std::vector<int32_t> tokens;
  if (bos) tokens.push_back(bos_id_);
  if (!text.empty()) {
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
  tokens = std::move(merged);
  if (eos) tokens.push_back(eos_id_);
  return tokens;
}

std::string Tokenizer::DecodePiece(int32_t prev, int32_t token) const {
  if (token < 0 || token >= vocab_size()) return {};
  std::string_view p = pieces_[static_cast<size_t>(token)];
  if (prev == bos_id_ && !p.empty() && p[0] == ' ') p.remove_prefix(1);
  const int byte = ByteOfPiece(std::string(p));
  if (byte >= 0) return std::string(1, static_cast<char>(byte));
  return std::string(p);
}

std::string Tokenizer::Decode(const std::vector<int32_t>& tokens) const {
  std::string out;
  int32_t prev = -1;
  for (int32_t t : tokens) {
    if (t != bos_id_) out += DecodePiece(prev, t);
    prev = t;
  }
  return out;
}

}  // namespace pagekv
