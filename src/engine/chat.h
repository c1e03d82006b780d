// Chat prompts: a conversation (OpenAI-style messages) rendered through the
// model's own chat template (GGUF tokenizer.chat_template, Jinja, rendered
// by src/jinja as Hugging Face renders it), or through a built-in template
// named on the command line, then encoded with special tokens parsed.
//
// Built-in templates (for files without one, or to override it): chatml,
// llama3, llama2, mistral, gemma, phi3, zephyr. A template file may be given
// instead of a name. A gemma-family file without a template gets the gemma
// one (the family's format is fixed: FallbackTemplateName).
//
// Stop tokens: the end-of-sequence id and every control token the vocabulary
// has among the end-of-turn markers of the common templates (<|im_end|>,
// <|eot_id|>, <|eom_id|>, <end_of_turn>, <|end|>, <|endoftext|>, </s>,
// <|return|>) or names as tokenizer.ggml.eot_token_id / eom_token_id.
//
// Thread safety: immutable after Create; Render may run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "jinja/jinja.h"
#include "model/gguf_file.h"
#include "model/tokenizer.h"
#include "pagekv/status.h"

namespace pagekv {

class ChatTemplate {
 public:
  // `source`: the model's template (empty when the file has none); `override`:
  // a built-in name or a template file path (empty: use the model's). Errors:
  // no template at all (named, with the built-in names), an unknown name
  // that is no readable file, a template that does not parse (its line and
  // the construct named).
  static Result<ChatTemplate> Create(const std::string& source, const std::string& override_name,
                                     const Tokenizer& tokenizer, const GgufFile* file = nullptr);

  // messages: an array of {"role", "content", ...} objects (extra fields,
  // tools and the like, reach the template as they are). Errors (kInvalidArgument):
  // not an array of objects, a template that raises or fails (its message).
  Result<std::string> Render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                             const nlohmann::ordered_json& tools = nullptr) const;
  // Render, then encode with special tokens parsed and no BOS beyond what
  // the template writes.
  Result<std::vector<int32_t>> Encode(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                      const nlohmann::ordered_json& tools = nullptr) const;

  // Tokens that end an assistant turn (EOS included).
  const std::vector<int32_t>& stop_tokens() const { return stop_tokens_; }
  const std::string& name() const { return name_; }  // "model" or the built-in's / file's name

  // The built-in template of a name, or nullptr.
  static const char* BuiltIn(std::string_view name);
  // The built-in a model of this architecture (general.architecture) chats
  // in when its file has no template: "gemma" for the gemma family (whose
  // converted files often lack one), else empty (none implied).
  static std::string FallbackTemplateName(std::string_view arch);

 private:
  ChatTemplate() = default;
  std::shared_ptr<const jinja::Template> template_;
  const Tokenizer* tokenizer_ = nullptr;
  std::string bos_, eos_, name_;
  std::vector<int32_t> stop_tokens_;
};

}  // namespace pagekv
