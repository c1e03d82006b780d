// llama-server's own endpoints over the same engine: /tokenize,
// /detokenize, /apply-template, /props, /slots, and the answer shapes of
// /completion (docs/OPENAI_API.md, "llama-server endpoints").
#include <limits>
#include <string>
#include <vector>

#include <boost/asio/post.hpp>

#include "base/json_nesting.h"
#include "base/utf8.h"
#include "pagekv/version.h"
#include "server/request.h"
#include "server/server_state.h"

namespace pagekv::server {
namespace {

using json = nlohmann::json;

json Bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(c);
  return b;
}

// A piece as llama-server writes it: the text when it is whole UTF-8, else
// its bytes.
json PieceJson(const std::string& piece) { return IsValidUtf8(piece) ? json(piece) : Bytes(piece); }

// A body that must be a JSON object (any content type: curl -d sends a form).
bool ParseObject(Shared& sh, Exchange& ex, const HttpRequest& req, json& body) {
  if (Status deep = CheckJsonNesting(req.body, "the body"); !deep.ok()) {
    AnswerError(sh, ex, 400, deep.message());
    return false;
  }
  body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    AnswerError(sh, ex, 400, "the body must be a JSON object");
    return false;
  }
  return true;
}

void Tokenize(Shared& sh, Exchange& ex, const json& body) {
  if (!body.contains("content") || !body["content"].is_string()) {
    return AnswerError(sh, ex, 400, "'content' must be a string", "content");
  }
  for (const char* flag : {"add_special", "parse_special", "with_pieces"}) {
    if (body.contains(flag) && !body[flag].is_boolean()) {
      return AnswerError(sh, ex, 400, std::string("'") + flag + "' must be a boolean", flag);
    }
  }
  const std::string& text = body["content"].get_ref<const std::string&>();
  const uint64_t most = static_cast<uint64_t>(sh.engine->context_len()) * 64;
  if (text.size() > most) {
    return AnswerError(sh, ex, 400, "'content' is longer than this server tokenizes (" + std::to_string(most) + " bytes)",
                       "content");
  }
  const std::vector<int32_t> ids =
      sh.engine->Encode(text, body.value("add_special", false), body.value("parse_special", true));
  json tokens = json::array();
  for (int32_t id : ids) {
    if (body.value("with_pieces", false)) {
      tokens.push_back({{"id", id}, {"piece", PieceJson(sh.engine->TokenPiece(id))}});
    } else {
      tokens.push_back(id);
    }
  }
  AnswerJson(sh, ex, Dump({{"tokens", std::move(tokens)}}));
}

void Detokenize(Shared& sh, Exchange& ex, const json& body) {
  const json* t = body.contains("tokens") ? &body["tokens"] : nullptr;
  if (t == nullptr || !t->is_array()) return AnswerError(sh, ex, 400, "'tokens' must be an array of token ids", "tokens");
  std::vector<int32_t> ids;
  for (const json& id : *t) {
    if (!IntegerIn(id, 0, sh.engine->vocab_size() - 1)) {
      return AnswerError(sh, ex, 400,
                         "token id " + id.dump() + " is outside [0, " + std::to_string(sh.engine->vocab_size()) + ")",
                         "tokens");
    }
    ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
  }
  AnswerJson(sh, ex, Dump({{"content", sh.engine->Detokenize(ids)}}));
}

void ApplyTemplate(Shared& sh, Exchange& ex, const json& body) {
  const json* m = body.contains("messages") ? &body["messages"] : nullptr;
  if (m == nullptr || !m->is_array() || m->empty()) return AnswerError(sh, ex, 400, "'messages' must be a non-empty array", "messages");
  Result<std::string> prompt = sh.engine->RenderChat(m->dump(), /*add_generation_prompt=*/true);
  if (!prompt.ok()) return AnswerError(sh, ex, 400, prompt.status().message(), "messages");
  AnswerJson(sh, ex, Dump({{"prompt", *prompt}}));
}

void Props(Shared& sh, Exchange& ex) {
  const EngineMetrics m = sh.engine->Metrics();
  json kv = json::object();
  for (const auto& [k, v] : sh.cache_config) kv[k] = v;
  const json settings = {{"n_ctx", sh.engine->context_len()}, {"temperature", 0.8}, {"top_k", 40}, {"top_p", 0.95},
                         {"n_predict", -1}};
  const json out = {{"model_path", sh.model},
                    {"model_alias", sh.model},
                    {"n_ctx", sh.engine->context_len()},
                    {"total_slots", sh.max_running},
                    {"chat_template", sh.engine->chat_template_name()},
                    {"default_generation_settings", settings},
                    {"kv_cache",
                     {{"block_size", std::stoll(kv.value("block_size", "0"))},
                      {"num_blocks", m.blocks_total},
                      {"bytes_per_block", m.bytes_per_block},
                      {"bytes_per_token", m.bytes_per_token},
                      {"dtype", kv.value("cache_dtype", "")},
                      {"prefix_caching", kv.value("enable_prefix_caching", "False") == "True"},
                      {"blocks_used", m.blocks_used},
                      {"blocks_cached", m.blocks_cached}}},
                    {"build_info", std::string("pagekv ") + PAGEKV_VERSION}};
  AnswerJson(sh, ex, Dump(out));
}

void Slots(Shared& sh, Exchange& ex) {
  const EngineMetrics m = sh.engine->Metrics();
  json slots = json::array();
  for (const SequenceInfo& s : m.sequences) {
    slots.push_back({{"id", s.id},
                     {"id_task", s.id},
                     {"n_ctx", sh.engine->context_len()},
                     {"is_processing", true},
                     {"state", s.prefilling ? "prefill" : "decode"},
                     {"n_prompt_tokens", s.prompt_tokens},
                     {"n_decoded", s.generated_tokens},
                     {"kv_tokens", s.kv_tokens},
                     {"kv_blocks", s.kv_blocks},
                     {"kv_bytes", s.kv_blocks * m.bytes_per_block},
                     {"priority", s.priority}});
  }
  AnswerJson(sh, ex, Dump(slots));
}

const char* StopType(FinishReason f) {
  switch (f) {
    case FinishReason::kEos: return "eos";
    case FinishReason::kStop: return "word";
    case FinishReason::kLength: return "limit";
    default: return "none";
  }
}

}  // namespace

bool IsLlamaRoute(const std::string& path) {
  return path == "/tokenize" || path == "/detokenize" || path == "/apply-template" || path == "/props" ||
         path == "/slots";
}

void HandleLlama(Shared& sh, const HttpRequest& req, const std::shared_ptr<Exchange>& ex) {
  const bool get_route = req.path == "/props" || req.path == "/slots";
  const char* method = get_route ? "GET" : "POST";
  if (req.method != method) {
    return AnswerError(sh, *ex, 405, "use " + std::string(method) + " on " + req.path, "", {{"Allow", method}});
  }
  // Tokenizing and the engine's lock: on a worker, not an I/O thread.
  boost::asio::post(*sh.workers, [&sh, req, ex] {
    try {
      if (req.path == "/props") return Props(sh, *ex);
      if (req.path == "/slots") return Slots(sh, *ex);
      json body;
      if (!ParseObject(sh, *ex, req, body)) return;
      if (req.path == "/tokenize") return Tokenize(sh, *ex, body);
      if (req.path == "/detokenize") return Detokenize(sh, *ex, body);
      return ApplyTemplate(sh, *ex, body);
    } catch (...) {  // never the exception's text to the client
      AnswerError(sh, *ex, 500, "internal error while handling the request");
    }
  });
}

json LlamaProbs(const Shared& sh, const std::vector<TokenLogprob>& lps) {
  // Per token: its id, piece, bytes, log-probability and the top ones.
  auto entry = [&](int32_t id, float lp) {
    const std::string p = sh.engine->TokenPiece(id);
    return json{{"id", id}, {"token", p}, {"bytes", Bytes(p)}, {"logprob", lp}};
  };
  json probs = json::array();
  for (const TokenLogprob& t : lps) {
    json e = entry(t.token, t.logprob);
    json top = json::array();
    for (const auto& [id, lp] : t.top) top.push_back(entry(id, lp));
    e["top_logprobs"] = std::move(top);
    probs.push_back(std::move(e));
  }
  return probs;
}

json LlamaChunk(const Shared& sh, const TokenUpdate& u, const std::string& text, int n_probs) {
  json tokens = json::array();
  if (u.token >= 0) tokens.push_back(u.token);
  json out = {{"index", 0}, {"content", text}, {"tokens", std::move(tokens)}, {"stop", false}, {"id_slot", -1}};
  if (n_probs > 0) out["completion_probabilities"] = LlamaProbs(sh, u.logprobs);
  return out;
}

json LlamaEnd(const Shared& sh, const RequestResult& r, const std::string& content, int n_probs) {
  const double prompt_ms = r.prefill_time * 1000, predicted_ms = r.decode_time * 1000;
  const int64_t computed = r.prompt_tokens - r.cached_prompt_tokens;
  const auto n = static_cast<int64_t>(r.tokens.size());
  auto per = [](double ms, int64_t k) { return k > 0 ? ms / static_cast<double>(k) : 0.0; };
  auto rate = [](double ms, int64_t k) { return ms > 0 ? static_cast<double>(k) * 1000.0 / ms : 0.0; };
  json out = {{"index", 0},
              {"content", content},
              {"tokens", json::array()},
              {"id_slot", -1},
              {"stop", true},
              {"model", sh.model},
              {"tokens_predicted", n},
              {"tokens_evaluated", r.prompt_tokens},
              {"tokens_cached", r.cached_prompt_tokens},
              {"truncated", false},
              {"stop_type", StopType(r.finish)},
              {"stopping_word", ""},
              {"timings",
               {{"prompt_n", computed},
                {"prompt_ms", prompt_ms},
                {"prompt_per_token_ms", per(prompt_ms, computed)},
                {"prompt_per_second", rate(prompt_ms, computed)},
                {"predicted_n", n},
                {"predicted_ms", predicted_ms},
                {"predicted_per_token_ms", per(predicted_ms, n > 1 ? n - 1 : 0)},
                {"predicted_per_second", rate(predicted_ms, n > 1 ? n - 1 : 0)}}}};
  if (n_probs > 0) {
    out["completion_probabilities"] = LlamaProbs(sh, TokenLogprobs(r));
  }
  return out;
}

}  // namespace pagekv::server
