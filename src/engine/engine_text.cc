// Engine's text and model accessors (include/pagekv/engine.h): the
// tokenizer, the chat template and the model's sizes, read-only over the
// engine's state.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/json_nesting.h"
#include "engine/engine_state.h"
#include "pagekv/engine.h"

namespace pagekv {

std::vector<int32_t> Engine::Encode(const std::string& text) const {
  return state_->m.tokenizer->EncodePrompt(text, /*parse_special=*/true);
}

std::vector<int32_t> Engine::Encode(const std::string& text, bool add_special, bool parse_special) const {
  const Tokenizer& t = *state_->m.tokenizer;
  return t.Encode(text, add_special && t.add_bos(), add_special && t.add_eos(), parse_special);
}

std::string Engine::TokenPiece(int32_t token) const {
  const Tokenizer& t = *state_->m.tokenizer;
  // After a non-BOS token: no leading-space rule of a sequence's start.
  return t.DecodePiece(-1, token, /*specials=*/true);
}

Result<std::vector<int32_t>> Engine::EncodeChat(const std::string& messages_json, bool add_generation_prompt,
                                                const std::string& tools_json) const {
  const State& st = *state_;
  if (!st.chat) return st.chat_error;
  const nlohmann::ordered_json messages = nlohmann::ordered_json::parse(messages_json, nullptr, /*allow_exceptions=*/false);
  if (messages.is_discarded()) return InvalidArgumentError("chat: the messages are not valid JSON");
  PAGEKV_RETURN_IF_ERROR(CheckJsonNesting(messages_json, "chat: the messages"));
  nlohmann::ordered_json tools;
  if (!tools_json.empty()) {
    tools = nlohmann::ordered_json::parse(tools_json, nullptr, false);
    if (tools.is_discarded()) return InvalidArgumentError("chat: the tools are not valid JSON");
    PAGEKV_RETURN_IF_ERROR(CheckJsonNesting(tools_json, "chat: the tools"));
  }
  return st.chat->Encode(messages, add_generation_prompt, tools);
}

Result<std::string> Engine::RenderChat(const std::string& messages_json, bool add_generation_prompt) const {
  const State& st = *state_;
  if (!st.chat) return st.chat_error;
  const nlohmann::ordered_json messages = nlohmann::ordered_json::parse(messages_json, nullptr, /*allow_exceptions=*/false);
  if (messages.is_discarded()) return InvalidArgumentError("chat: the messages are not valid JSON");
  PAGEKV_RETURN_IF_ERROR(CheckJsonNesting(messages_json, "chat: the messages"));
  return st.chat->Render(messages, add_generation_prompt);
}

const std::vector<int32_t>& Engine::stop_tokens() const { return state_->stop_tokens; }

std::string Engine::chat_template_name() const {
  const State& st = *state_;
  if (!st.chat) return "none (" + st.chat_error.message() + ")";
  if (st.m.chat_template.empty() && st.o.chat_template.empty()) return "chatml (the model has no chat template)";
  return st.chat->name() == "model" ? "the model's (tokenizer.chat_template)" : st.chat->name();
}

std::string Engine::Detokenize(const std::vector<int32_t>& tokens) const { return state_->m.tokenizer->Decode(tokens); }

std::string Engine::Decode(const std::vector<int32_t>& tokens, int32_t prev) const {
  std::string out;
  for (int32_t t : tokens) {
    out += state_->m.tokenizer->DecodePiece(prev, t);
    prev = t;
  }
  return out;
}

int32_t Engine::context_len() const { return state_->m.model->config().context_len; }

int32_t Engine::vocab_size() const { return state_->m.model->config().vocab_size; }

int32_t Engine::max_token_bytes() const { return state_->m.tokenizer->max_piece_bytes(); }
int32_t Engine::eos_id() const { return state_->m.tokenizer->eos_id(); }

}  // namespace pagekv
