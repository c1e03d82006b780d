// What the router needs of the model to turn a request body into the tokens
// a backend will compute: the tokenizer, the chat template (chosen as the
// engine chooses it) and the context length, read from the model file
// without its weights (a GGUF's metadata; a llama2.c checkpoint's header and
// tokenizer file). With server::ParseRequest over it, the router and the
// backends parse a body identically.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "engine/chat.h"
#include "model/tokenizer.h"
#include "server/request.h"

namespace pagekv::router {

class ModelText final : public server::RequestText {
 public:
  static Result<std::unique_ptr<ModelText>> Open(const std::string& model_path, const std::string& tokenizer_path,
                                                 const std::string& chat_template);
  std::vector<int32_t> Encode(const std::string& text) const override;
  Result<std::vector<int32_t>> EncodeChat(const std::string& messages_json, bool add_generation_prompt,
                                          const std::string& tools_json) const override;
  std::string Detokenize(const std::vector<int32_t>& tokens) const override;
  int32_t context_len() const override { return context_len_; }
  int32_t vocab_size() const override { return tokenizer_->vocab_size(); }
  int32_t max_token_bytes() const override { return tokenizer_->max_piece_bytes(); }

 private:
  ModelText() = default;
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::optional<ChatTemplate> chat_;
  Status chat_error_ = Status::Ok();
  int32_t context_len_ = 0;
};

}  // namespace pagekv::router
