// The server's answers: OpenAI's error objects, API keys, JSON text.
#include <openssl/crypto.h>

#include "server/request.h"
#include "server/server_state.h"

namespace pagekv::server {
namespace {

using json = nlohmann::json;

// OpenAI's error object: a type its SDKs map to exception classes (with
// the HTTP status) and a string code naming the case (docs/OPENAI_API.md).
std::string ErrorType(int status) {
  switch (status) {
    case 401: return "authentication_error";
    case 429: return "rate_limit_error";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

std::string ErrorCode(int status) {
  switch (status) {
    case 400: return "invalid_request_error";
    case 401: return "invalid_api_key";
    case 404: return "not_found";
    case 405: return "method_not_allowed";
    case 413: return "request_too_large";
    case 415: return "unsupported_media_type";
    case 429: return "rate_limit_exceeded";
    case 431: return "request_header_fields_too_large";
    case 501: return "not_implemented";
    case 503: return "service_unavailable";
    case 505: return "http_version_not_supported";
    default: return status >= 500 ? "internal_error" : "invalid_request_error";
  }
}

}  // namespace

std::string ErrorJson(int status, const std::string& message, const std::string& param, std::string code) {
  json e = {{"error", {{"message", message}, {"type", ErrorType(status)}, {"param", param.empty() ? json(nullptr) : json(param)},
                       {"code", code.empty() ? ErrorCode(status) : code}}}};
  // Replacing invalid UTF-8 (a model name, a parser's quote of the body):
  // an error answer must never throw.
  return e.dump(-1, ' ', false, json::error_handler_t::replace);
}

// Which API key the request carries: its index, -1 for none or a wrong one.
// Every key is compared, in constant time, whatever matches.
int KeyIndex(const Shared& sh, const std::string& auth) {
  if (auth.rfind("Bearer ", 0) != 0) return -1;
  const std::array<unsigned char, 32> d = Sha256(std::string_view(auth).substr(7));
  int found = -1;
  for (size_t i = 0; i < sh.key_digests.size(); ++i) {
    const bool eq = CRYPTO_memcmp(d.data(), sh.key_digests[i].data(), d.size()) == 0;
    found = eq ? static_cast<int>(i) : found;
  }
  return found;
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void Answer(Shared&, Exchange& ex, HttpResponse r) { ex.Respond(std::move(r)); }

void AnswerJson(Shared& sh, Exchange& ex, std::string body) { Answer(sh, ex, {200, "application/json", {}, std::move(body)}); }

void AnswerError(Shared& sh, Exchange& ex, int status, const std::string& message, const std::string& param,
                 std::vector<std::pair<std::string, std::string>> headers, std::string code) {
  Answer(sh, ex, {status, "application/json", std::move(headers), ErrorJson(status, message, param, std::move(code))});
}

}  // namespace pagekv::server
