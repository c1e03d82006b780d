// Tokenizer: the SentencePiece-style BPE of llama-family checkpoints, with the
// exact conventions of llama2.c's run.c (which ../shared/goldens follow):
//
//   Encode: optional BOS; a dummy-prefix " " token when the text is not
//   empty; every UTF-8 character looked up as a piece, or its bytes as byte
//   tokens (<0xXX>) when it has none; then, repeatedly, the adjacent pair
//   whose concatenation is a piece with the highest score (leftmost on ties)
//   is merged, until no pair merges; optional EOS.
//   Decode: a piece right after BOS loses its leading space; <0xXX> pieces
//   are that byte.
//
// Pieces from GGUF use U+2581 ("▁") for spaces; they are stored with plain
// spaces so both checkpoint formats behave the same.
//
// Thread safety: immutable after construction.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/gguf_file.h"
#include "pagekv/status.h"

namespace pagekv {

class Tokenizer {
 public:
  // From GGUF metadata: tokenizer.ggml.tokens / scores (and bos/eos ids).
  static Result<Tokenizer> FromGguf(const GgufFile& file);
  // From a llama2.c tokenizer.bin holding `vocab_size` pieces.
  static Result<Tokenizer> FromLlama2c(const std::string& path, int32_t vocab_size);
  // From pieces and scores directly (tests, synthetic models).
  static Result<Tokenizer> FromPieces(std::vector<std::string> pieces, std::vector<float> scores,
                                      int32_t bos_id, int32_t eos_id);

  std::vector<int32_t> Encode(std::string_view text, bool bos, bool eos) const;

  // The text of `token` following `prev` (run.c's decode).
  std::string DecodePiece(int32_t prev, int32_t token) const;
  // Concatenated DecodePiece over `tokens` (the first one follows BOS only
  // if it is preceded by a BOS in `tokens`).
  std::string Decode(const std::vector<int32_t>& tokens) const;

  int32_t vocab_size() const { return static_cast<int32_t>(pieces_.size()); }
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  const std::string& piece(int32_t id) const { return pieces_[static_cast<size_t>(id)]; }

 private:
  Tokenizer() = default;
  void Index();
  int32_t Lookup(std::string_view s) const;

  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int32_t> ids_;
  int32_t byte_ids_[256] = {};  // id of the piece <0xXX>, or -1
  int32_t bos_id_ = 1;
  int32_t eos_id_ = 2;
};

}  // namespace pagekv
