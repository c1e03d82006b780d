// LoadModel (model_loader.h): a GGUF, or a llama2.c checkpoint and its tokenizer.
#include "model/model_loader.h"

#include <unistd.h>

#include <cstring>

#include "base/regular_file.h"

#include "model/gguf_file.h"
#include "model/llama_model.h"

namespace pagekv {

Result<LoadedModel> LoadModel(const std::string& model_path, const std::string& tokenizer_path,
                              ModelParallel parallel) {
  if (model_path.empty()) return InvalidArgumentError("no model: pass --model PATH (a .gguf or a llama2.c .bin)");
  char magic[4] = {};
  {
    PAGEKV_ASSIGN_OR_RETURN(RegularFile f, OpenRegularFile(model_path, "model file"));
    const ssize_t n = ::pread(f.fd, magic, 4, 0);
    ::close(f.fd);
    if (n != 4) return DataLossError("model file '" + model_path + "' is too small to be a model");
  }
  LoadedModel out;
  if (std::memcmp(magic, "GGUF", 4) == 0) {
    PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::Open(model_path));
    PAGEKV_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::FromGguf(*file));
    out.tokenizer = std::make_unique<Tokenizer>(std::move(tok));
    if (file->Find("tokenizer.chat_template") != nullptr) {
      PAGEKV_ASSIGN_OR_RETURN(out.chat_template, file->GetString("tokenizer.chat_template"));
    }
    out.stop_tokens = StopTokens(*out.tokenizer, file.get());
    PAGEKV_ASSIGN_OR_RETURN(out.model, LoadGgufModel(std::move(file), parallel));
  } else {
    if (tokenizer_path.empty()) {
      return InvalidArgumentError("'" + model_path + "' is not GGUF, so it is read as a llama2.c checkpoint, which "
                                  "needs its tokenizer: pass --tokenizer PATH (e.g. tok512.bin)");
    }
    PAGEKV_ASSIGN_OR_RETURN(out.model, LlamaModel::FromLlama2c(model_path, parallel));
    PAGEKV_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::FromLlama2c(tokenizer_path, out.model->config().vocab_size));
    out.tokenizer = std::make_unique<Tokenizer>(std::move(tok));
    out.stop_tokens = StopTokens(*out.tokenizer);
  }
  if (out.tokenizer->vocab_size() != out.model->config().vocab_size) {
    return DataLossError("the tokenizer has " + std::to_string(out.tokenizer->vocab_size()) +
                         " pieces but the model's vocabulary is " + std::to_string(out.model->config().vocab_size));
  }
  return out;
}

}  // namespace pagekv
