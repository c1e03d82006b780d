// libFuzzer target: arbitrary bytes as the body of a completion or chat
// request (the first byte picks the endpoint, OpenAI's completions or chat
// or llama-server's /completion, and whether an API key's salt applies), through the JSON parser and ParseRequest over a real engine on
// stories260K (its tokenizer and chat template). A hostile body must only
// ever give a FieldError or an EngineRequest within the documented bounds:
// any crash, sanitizer report, leak, escaping exception or allocation past
// libFuzzer's -malloc_limit_mb is a bug. Built in the asan build (clang);
// `make test` runs it for 60 s from the repository's root.
#include <cstddef>
#include <cstdint>
#include <string>

#include "server/fuzz_request_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool chat = (data[0] & 1) != 0;
  const std::string key_salt = (data[0] & 2) != 0 ? std::string(16, '\x5a') : std::string();
  const bool llama = (data[0] & 4) != 0;
  pagekv::server::fuzz::CheckBody(
      nlohmann::json::parse(reinterpret_cast<const char*>(data + 1), reinterpret_cast<const char*>(data + size), nullptr,
                            /*allow_exceptions=*/false),
      chat, key_salt, llama);
  return 0;
}
