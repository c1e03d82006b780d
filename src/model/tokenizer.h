// Tokenizer: the two kinds GGUF files carry.
//
// SentencePiece (tokenizer.ggml.model = "llama"; also llama2.c's
// tokenizer.bin), with the exact conventions of llama2.c's run.c (which
// ../shared/goldens follow):
//   Encode: optional BOS; user-defined pieces (GGUF token type 4) cut out
//   of the text; a dummy-prefix " " token when a span is not empty (unless
//   tokenizer.ggml.add_space_prefix is false: Gemma); every UTF-8 character looked up as a piece, or its bytes as byte
//   tokens (<0xXX>) when it has none; then, repeatedly, the adjacent pair
//   whose concatenation is a piece with the highest score (leftmost on ties)
//   is merged, until no pair merges; optional EOS.
//   Decode: a piece right after BOS loses its leading space; <0xXX> pieces
//   are that byte.
//   Pieces from GGUF use U+2581 ("▁") for spaces; they are stored with plain
//   spaces so both checkpoint formats behave the same.
//
// GPT-2 byte-level BPE (tokenizer.ggml.model = "gpt2": Llama 3, Qwen2,
// SmolLM, GPT-2 and most recent models):
//   Encode: special tokens (control and user-defined pieces, such as
//   "<|im_start|>") are cut out of the text first when asked for; each other
//   span is split by the pre-tokenizer that tokenizer.ggml.pre names (its
//   regular expressions, Unicode-aware through PCRE2); each piece's UTF-8
//   bytes become one symbol per byte (GPT-2's byte-to-character mapping,
//   under which the vocabulary is written), and the adjacent pair with the
//   lowest merge rank (tokenizer.ggml.merges, leftmost on ties) is merged
//   until none is left. Invalid UTF-8 in the input is replaced by U+FFFD.
//   Decode: each token's characters back to their bytes; a token may end in
//   the middle of a UTF-8 character (Utf8Stream joins them).
//
// Thread safety: immutable after construction; copies share the compiled
// pre-tokenizer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/gguf_file.h"
#include "pagekv/status.h"

namespace pagekv {

class Tokenizer {
 public:
  enum class Kind : uint8_t { kSentencePiece, kByteBpe };

  // From GGUF metadata: tokenizer.ggml.model ("llama" or "gpt2"; any other
  // is refused by name), tokens, scores or merges, token types,
  // tokenizer.ggml.pre (byte-level BPE; unknown values refused by name),
  // BOS / EOS ids and add_bos_token / add_eos_token.
  static Result<Tokenizer> FromGguf(const GgufFile& file);
  // From a llama2.c tokenizer.bin holding `vocab_size` pieces.
  static Result<Tokenizer> FromLlama2c(const std::string& path, int32_t vocab_size);
  // From pieces and scores directly (tests, synthetic models): SentencePiece.
  static Result<Tokenizer> FromPieces(std::vector<std::string> pieces, std::vector<float> scores,
                                      int32_t bos_id, int32_t eos_id);

  // `parse_special`: special tokens written in the text (e.g. by a chat
  // template) become their ids; otherwise they are ordinary text.
  std::vector<int32_t> Encode(std::string_view text, bool bos, bool eos, bool parse_special = false) const;
  // Encode with the model's own BOS / EOS convention (add_bos_token, which
  // SentencePiece models default to true and byte-level BPE to false).
  std::vector<int32_t> EncodePrompt(std::string_view text, bool parse_special = false) const {
    return Encode(text, add_bos_, add_eos_, parse_special);
  }

  // The bytes of `token` following `prev`. A control token (BOS, EOS,
  // "<|im_end|>") is empty unless `specials`. Byte-level BPE tokens may end
  // inside a UTF-8 character.
  std::string DecodePiece(int32_t prev, int32_t token, bool specials = false) const;
  // Concatenated DecodePiece over `tokens` (the first one follows BOS only
  // if it is preceded by a BOS in `tokens`).
  std::string Decode(const std::vector<int32_t>& tokens, bool specials = false) const;

  Kind kind() const { return kind_; }
  int32_t vocab_size() const { return static_cast<int32_t>(pieces_.size()); }
  // The most bytes of text one token can stand for (the longest stored
  // piece, which is never shorter than the text it encodes): a text of n
  // bytes is at least n / max_piece_bytes() tokens, known before encoding.
  int32_t max_piece_bytes() const { return max_piece_bytes_; }
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }
  // The piece as the vocabulary stores it (byte-level BPE: in GPT-2's
  // mapped characters, e.g. "Ġthe").
  const std::string& piece(int32_t id) const { return pieces_[static_cast<size_t>(id)]; }
  // The id of a piece written exactly so (e.g. "<|im_end|>"), if any.
  std::optional<int32_t> TokenId(std::string_view piece) const;
  // Control tokens: BOS/EOS and the like, not text.
  bool IsControl(int32_t id) const;
  // The pre-tokenizer's name (byte-level BPE), e.g. "smollm".
  const std::string& pre() const { return pre_; }

 private:
  struct Bpe;  // merges, byte mapping, the compiled pre-tokenizer (tokenizer.cc)

  Tokenizer() = default;
  void Index();
  int32_t Lookup(std::string_view s) const;
  std::vector<int32_t> EncodeSentencePiece(std::string_view text) const;
  void EncodeBpeSpan(std::string_view text, std::vector<int32_t>& out) const;

  Kind kind_ = Kind::kSentencePiece;
  std::vector<std::string> pieces_;
  int32_t max_piece_bytes_ = 1;
  std::vector<float> scores_;
  std::vector<uint8_t> types_;  // GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
  std::unordered_map<std::string, int32_t> ids_;
  int32_t byte_ids_[256] = {};  // SentencePiece: id of the piece <0xXX>, or -1
  std::vector<int32_t> specials_;  // ids matched in the text when parse_special, longest first
  std::vector<std::vector<int32_t>> specials_by_byte_;  // specials_ by their first byte, longest first
  std::shared_ptr<const Bpe> bpe_;
  std::string pre_;
  int32_t bos_id_ = 1;
  int32_t eos_id_ = 2;
  bool add_bos_ = true;
  bool add_eos_ = false;
  bool add_space_prefix_ = true;  // SentencePiece: tokenizer.ggml.add_space_prefix (Gemma: false)
};

// Joins the bytes of streamed tokens into whole UTF-8 characters: Push
// returns the text that is complete so far and keeps an unfinished
// character's first bytes for the next call. Finish returns what is left
// (an unfinished character at the very end becomes U+FFFD).
class Utf8Stream {
 public:
  std::string Push(std::string_view bytes);
  std::string Finish();

 private:
  std::string pending_;
};

// `s` with every invalid UTF-8 sequence replaced by U+FFFD.
std::string SanitizeUtf8(std::string_view s);

// The stop tokens of a tokenizer without a chat template: the end-of-sequence
// id and every control token the vocabulary has among the end-of-turn markers
// of the common templates (<|im_end|>, <|eot_id|>, <|eom_id|>,
// <end_of_turn>, <|end|>, <|endoftext|>, </s>, <|return|>) or names as
// tokenizer.ggml.eot_token_id / eom_token_id.
std::vector<int32_t> StopTokens(const Tokenizer& tokenizer, const GgufFile* file = nullptr);

}  // namespace pagekv
