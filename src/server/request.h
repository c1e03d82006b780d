// The body of a completion or chat request, checked field by field and
// turned into an EngineRequest: every number range-checked before it is
// converted (no wrap-around), every error naming its field. No HTTP here:
// the transport hands over a parsed JSON object (and the fuzz target
// arbitrary ones).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "pagekv/engine.h"

namespace pagekv::server {

// A request field error: names the field; `code` is OpenAI's error code
// when it is not the generic one ("context_length_exceeded").
struct FieldError {
  std::string field, message, code;
};

// Every choice of a request: prompts x n engine requests, choice i from
// prompt i / n (OpenAI's order). Choices of one prompt differ only in their
// seed (seed + i when one is given).
struct ParsedRequest {
  std::vector<EngineRequest> choices;
  std::vector<std::string> echo;  // per choice: the prompt's text to put before the answer ("" without echo)
  int n = 1;
  int logprobs = -1;  // -1: off; else log-probabilities with this many top alternatives per token
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a last chunk with the usage
  bool own_salt = false;  // the body brought its own cache_salt
};

// At most this many choices (prompts x n) in one request.
inline constexpr int kMaxChoices = 64;

// What parsing a request needs of the model: its tokenizer, chat template
// and sizes. The server's is its engine's (EngineText); a router's reads
// them from the model file alone, so both turn one body into the same
// tokens.
class RequestText {
 public:
  virtual ~RequestText() = default;
  virtual std::vector<int32_t> Encode(const std::string& text) const = 0;
  virtual Result<std::vector<int32_t>> EncodeChat(const std::string& messages_json, bool add_generation_prompt,
                                                  const std::string& tools_json) const = 0;
  virtual std::string Detokenize(const std::vector<int32_t>& tokens) const = 0;
  virtual int32_t context_len() const = 0;
  virtual int32_t vocab_size() const = 0;
  virtual int32_t max_token_bytes() const = 0;
};

class EngineText final : public RequestText {
 public:
  explicit EngineText(const Engine& engine) : e_(engine) {}
  std::vector<int32_t> Encode(const std::string& text) const override { return e_.Encode(text); }
  Result<std::vector<int32_t>> EncodeChat(const std::string& messages_json, bool add_generation_prompt,
                                          const std::string& tools_json) const override {
    return e_.EncodeChat(messages_json, add_generation_prompt, tools_json);
  }
  std::string Detokenize(const std::vector<int32_t>& tokens) const override { return e_.Detokenize(tokens); }
  int32_t context_len() const override { return e_.context_len(); }
  int32_t vocab_size() const override { return e_.vocab_size(); }
  int32_t max_token_bytes() const override { return e_.max_token_bytes(); }

 private:
  const Engine& e_;
};

// The engine request of a completion (chat = false) or chat body; the
// prompt is tokenized (or the chat template rendered) by `engine`.
// key_salt: the API key's tenant salt ("" without keys); a body's
// "cache_salt" is mixed into it. Throws FieldError.
// until_context: without max_tokens a completion runs until the context ends
// (as a chat does), not OpenAI's 16.
ParsedRequest ParseRequest(const nlohmann::json& body, const RequestText& engine, const std::string& key_salt, bool chat,
                           bool until_context = false);
inline ParsedRequest ParseRequest(const nlohmann::json& body, const Engine& engine, const std::string& key_salt, bool chat,
                                  bool until_context = false) {
  return ParseRequest(body, EngineText(engine), key_salt, chat, until_context);
}

// llama-server's POST /completion body as the completions body ParseRequest
// reads: n_predict (-1: until the context ends, *until_context set),
// n_probs (logprobs), repeat_penalty, its array form of logit_bias, a seed
// of -1 (random), its sampling defaults (temperature 0.8, top_k 40, top_p
// 0.95); cache_prompt accepted (the prefix cache is on unless the server
// runs without it). What it has and PageKV has not (min_p, mirostat,
// grammar, ...) is a FieldError naming it. Throws FieldError.
nlohmann::json LlamaCompletionBody(const nlohmann::json& body, bool* until_context);

// A JSON integer within [lo, hi], whatever its JSON type (a large unsigned
// value is out of range, never wrapped).
bool IntegerIn(const nlohmann::json& v, int64_t lo, int64_t hi);

// A URL path segment with its %XX escapes decoded (RFC 3986; '+' stays a
// '+' in a path); nullopt when a '%' is not followed by two hex digits.
std::optional<std::string> PercentDecode(std::string_view segment);

// SHA-256 of a then b.
std::array<unsigned char, 32> Sha256(std::string_view a, std::string_view b = {});
// The cache salt of an API key's tenant (16 bytes derived from the key):
// what the server salts that key's requests with, and a router computes
// to predict their hits.
std::string TenantSalt(const std::string& api_key);

}  // namespace pagekv::server
