// ModelText (model_text.h).
#include "base/json_nesting.h"
#include "router/model_text.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>

#include "model/gguf_file.h"
#include "model/model_loader.h"

namespace pagekv::router {

Result<std::unique_ptr<ModelText>> ModelText::Open(const std::string& model_path, const std::string& tokenizer_path,
                                                   const std::string& chat_template) {
  std::unique_ptr<ModelText> t(new ModelText());
  std::string source, arch;
  char magic[4] = {};
  if (const int fd = ::open(model_path.c_str(), O_RDONLY | O_CLOEXEC); fd >= 0) {
    const ssize_t n = ::pread(fd, magic, 4, 0);
    ::close(fd);
    if (n != 4) return DataLossError("router: model file '" + model_path + "' is too small to be a model");
  } else {
    return NotFoundError("router: cannot open the model file '" + model_path + "' (--model): " + std::strerror(errno));
  }
  if (std::memcmp(magic, "GGUF", 4) == 0) {
    // Metadata only: the weights stay unread (the file is mapped, not loaded).
    PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::Open(model_path));
    PAGEKV_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::FromGguf(*file));
    t->tokenizer_ = std::make_shared<const Tokenizer>(std::move(tok));
    if (file->Find("tokenizer.chat_template") != nullptr) {
      PAGEKV_ASSIGN_OR_RETURN(source, file->GetString("tokenizer.chat_template"));
    }
    PAGEKV_ASSIGN_OR_RETURN(arch, file->GetString("general.architecture"));
    PAGEKV_ASSIGN_OR_RETURN(int64_t ctx, file->GetInt(arch + ".context_length"));
    if (ctx < 1 || ctx > (int64_t{1} << 30)) return DataLossError("router: " + arch + ".context_length is out of range");
    t->context_len_ = static_cast<int32_t>(ctx);
  } else {
    // A llama2.c checkpoint: small; its loader reads the header and the tokenizer.
    PAGEKV_ASSIGN_OR_RETURN(LoadedModel m, LoadModel(model_path, tokenizer_path));
    t->tokenizer_ = m.tokenizer;
    arch = m.model->config().arch;
    t->context_len_ = m.model->config().context_len;
  }
  // The engine's choice (engine.cc): the model's template, else the
  // family's built-in, else chatml; a named one must work.
  std::string name = chat_template;
  if (name.empty() && source.empty()) {
    name = ChatTemplate::FallbackTemplateName(arch);
    if (name.empty()) name = "chatml";
  }
  if (Result<ChatTemplate> chat = ChatTemplate::Create(source, name, *t->tokenizer_); chat.ok()) {
    t->chat_ = std::move(*chat);
  } else if (!chat_template.empty()) {
    return chat.status();
  } else {
    t->chat_error_ = chat.status();
  }
  return t;
}

std::vector<int32_t> ModelText::Encode(const std::string& text) const {
  return tokenizer_->EncodePrompt(text, /*parse_special=*/true);
}

Result<std::vector<int32_t>> ModelText::EncodeChat(const std::string& messages_json, bool add_generation_prompt,
                                                   const std::string& tools_json) const {
  if (!chat_) return chat_error_;
  const nlohmann::ordered_json messages = nlohmann::ordered_json::parse(messages_json, nullptr, false);
  if (messages.is_discarded()) return InvalidArgumentError("chat: the messages are not valid JSON");
  PAGEKV_RETURN_IF_ERROR(CheckJsonNesting(messages_json, "chat: the messages"));
  nlohmann::ordered_json tools;
  if (!tools_json.empty()) {
    tools = nlohmann::ordered_json::parse(tools_json, nullptr, false);
    if (tools.is_discarded()) return InvalidArgumentError("chat: the tools are not valid JSON");
    PAGEKV_RETURN_IF_ERROR(CheckJsonNesting(tools_json, "chat: the tools"));
  }
  return chat_->Encode(messages, add_generation_prompt, tools);
}

std::string ModelText::Detokenize(const std::vector<int32_t>& tokens) const { return tokenizer_->Decode(tokens); }

}  // namespace pagekv::router
