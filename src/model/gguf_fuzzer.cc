// libFuzzer target: arbitrary bytes through the GGUF reader, then everything
// that reads a parsed file (metadata getters, the tokenizer, the llama
// loader's validation). Any crash, sanitizer report, leak, or allocation past
// libFuzzer's -malloc_limit_mb is a bug: a hostile file must only ever give
// a Status. Built in the asan build (clang); `make test` runs it for 60 s.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "model/gguf_file.h"
#include "model/llama_model.h"
#include "model/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pagekv;
  Result<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes({reinterpret_cast<const char*>(data), size});
  if (!file.ok()) return 0;
  for (const auto& [key, value] : (*file)->metadata()) {
    (void)(*file)->GetInt(key);
    (void)(*file)->GetFloat(key);
    (void)(*file)->GetString(key);
  }
  if (Result<Tokenizer> tok = Tokenizer::FromGguf(**file); tok.ok()) {
    const std::vector<int32_t> ids = tok->Encode("Once upon a time \xe2\x96\x81 \xff", true, true);
    (void)tok->Decode(ids);
  }
  (void)LoadGgufModel(std::move(*file));
  return 0;
}
