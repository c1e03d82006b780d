// libFuzzer target: arbitrary bytes as a whole HTTP request, through the
// transport's parser and checks (ParseHttpRequest: Beast's parser, the
// header size and count limits, the body limit after de-chunking, the
// encoding and version checks) and, for a completion or chat request that
// passes, its body through the JSON parser and ParseRequest over a real
// engine on stories260K. The parser must give a request within the limits
// or a refusal with a 4xx/5xx status and a message; anything else (a crash,
// a sanitizer report, a leak, an escaping exception) is a bug. Built in the
// asan build (clang); `make test` runs it for 60 s from the repository root.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <variant>

#include "server/fuzz_request_check.h"
#include "server/http_transport.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pagekv::server;
  HttpLimits limits;
  limits.max_body_bytes = 16 * 1024;
  limits.max_header_bytes = 4096;
  limits.max_headers = 32;
  const auto parsed = ParseHttpRequest(std::string_view(reinterpret_cast<const char*>(data), size), limits);
  if (const auto* refusal = std::get_if<HttpRefusal>(&parsed)) {
    const int s = refusal->status;
    if (s != 400 && s != 413 && s != 415 && s != 431 && s != 501 && s != 505) std::abort();
    if (refusal->message.empty()) std::abort();
    return 0;
  }
  const HttpRequest& r = std::get<HttpRequest>(parsed);
  if (r.body.size() > static_cast<size_t>(limits.max_body_bytes)) std::abort();
  if (r.headers.size() > static_cast<size_t>(limits.max_headers)) std::abort();
  if (r.path.size() + r.query.size() > static_cast<size_t>(limits.max_header_bytes)) std::abort();
  for (const auto& [name, value] : r.headers) {
    for (char c : name) {
      if (c >= 'A' && c <= 'Z') std::abort();  // names come lower-case
    }
  }
  if (r.method == "POST" && (r.path == "/v1/completions" || r.path == "/v1/chat/completions" || r.path == "/completion")) {
    const bool chat = r.path == "/v1/chat/completions";
    const std::string salt = r.Header("authorization").empty() ? std::string() : std::string(16, '\x5a');
    fuzz::CheckBody(nlohmann::json::parse(r.body, nullptr, /*allow_exceptions=*/false), chat, salt, r.path == "/completion");
  }
  return 0;
}
