// Loading a model and its tokenizer by path: a .gguf (tokenizer embedded), or
// a llama2.c checkpoint with its tokenizer.bin. Shared by Generate and the
// serving engine.
#pragma once

#include <memory>
#include <string>

#include "model/model.h"
#include "model/tokenizer.h"
#include "pagekv/status.h"

namespace pagekv {

// Shared and immutable: several engines (one per cache configuration, as
// eval kv runs them) may compute with one loaded model.
struct LoadedModel {
  std::shared_ptr<const Model> model;
  std::shared_ptr<const Tokenizer> tokenizer;
  std::string chat_template;  // tokenizer.chat_template (Jinja source), empty when the file has none
  std::vector<int32_t> stop_tokens;  // EOS and the end-of-turn control tokens (chat.h's StopTokens)
};

// Errors: a missing file (NotFound), a llama2.c checkpoint without
// tokenizer_path, anything the loaders reject (named), a tokenizer whose size
// differs from the model's vocabulary. Split over ranks (`parallel`): this
// rank's tensor / pipeline shard (model.h).
Result<LoadedModel> LoadModel(const std::string& model_path, const std::string& tokenizer_path = {},
                              ModelParallel parallel = {});

}  // namespace pagekv
