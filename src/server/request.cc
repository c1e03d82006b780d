// Request bodies of the completion endpoints (request.h).
#include "server/request.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace pagekv::server {

using json = nlohmann::json;

std::array<unsigned char, 32> Sha256(std::string_view a, std::string_view b) {
  std::array<unsigned char, 32> d{};
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  unsigned int len = 0;
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  EVP_DigestUpdate(ctx, a.data(), a.size());
  EVP_DigestUpdate(ctx, b.data(), b.size());
  EVP_DigestFinal_ex(ctx, d.data(), &len);
  EVP_MD_CTX_free(ctx);
  return d;
}

// A JSON integer within [lo, hi], whatever its JSON type (a large unsigned
// value is out of range, never wrapped).
std::optional<std::string> PercentDecode(std::string_view segment) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(segment.size());
  for (size_t i = 0; i < segment.size(); ++i) {
    if (segment[i] != '%') {
      out.push_back(segment[i]);
      continue;
    }
    if (i + 2 >= segment.size()) return std::nullopt;  // a '%' needs two digits after it
    const int a = hex(segment[i + 1]), b = hex(segment[i + 2]);
    if (a < 0 || b < 0) return std::nullopt;
    out.push_back(static_cast<char>(a * 16 + b));
    i += 2;
  }
  return out;
}

bool IntegerIn(const json& v, int64_t lo, int64_t hi) {
  if (v.is_number_unsigned()) {  // hi >= 0 here, so a value <= hi fits int64
    const uint64_t u = v.get<uint64_t>();
    return hi >= 0 && u <= static_cast<uint64_t>(hi) && static_cast<int64_t>(u) >= lo;
  }
  return v.is_number_integer() && v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
}


namespace {

// OpenAI parameters that would change the answer but are not implemented:
// a 400 naming the field whenever one asks for something other than the
// default, never silently ignored (docs/OPENAI_API.md).
void RefuseUnsupported(const json& body) {
  auto given = [&](const char* name) -> const json* {
    return body.contains(name) && !body[name].is_null() ? &body[name] : nullptr;
  };
  auto refuse = [](const std::string& f, const std::string& why) {
    throw FieldError{f, "'" + f + "' " + why + " is not supported yet", "unsupported_parameter"};
  };
  if (const json* v = given("best_of"); v != nullptr && !(v->is_number_integer() && v->get<int64_t>() == 1)) {
    refuse("best_of", "other than 1");
  }
  if (const json* v = given("suffix"); v != nullptr && !(v->is_string() && v->get<std::string>().empty())) {
    refuse("suffix", "(insertion)");
  }
  if (const json* v = given("response_format")) {
    if (!(v->is_object() && v->contains("type") && (*v)["type"] == "text")) refuse("response_format", "other than {\"type\": \"text\"}");
  }
  if (const json* v = given("user"); v != nullptr && !v->is_string()) throw FieldError{"user", "'user' must be a string", ""};
}

}  // namespace

json LlamaCompletionBody(const json& body, bool* until_context) {
  auto given = [&](const char* name) -> const json* {
    return body.contains(name) && !body[name].is_null() ? &body[name] : nullptr;
  };
  auto fail = [](const std::string& f, const std::string& m, const std::string& code = {}) {
    throw FieldError{f, m, code};
  };
  json out = json::object();
  // The fields both APIs spell alike.
  for (const char* same : {"prompt", "temperature", "top_k", "top_p", "stop", "stream", "seed", "presence_penalty",
                           "frequency_penalty", "ignore_eos", "cache_salt"}) {
    if (const json* v = given(same)) out[same] = *v;
  }
  if (!given("prompt")) fail("prompt", "'prompt' is required");
  if (out["prompt"].is_array() && !out["prompt"].empty() && !out["prompt"][0].is_number_integer()) {
    fail("prompt", "one prompt per /completion request (a string or an array of token ids)");
  }
  // llama-server's sampling defaults.
  if (!given("temperature")) out["temperature"] = 0.8;
  if (!given("top_k")) out["top_k"] = 40;
  if (!given("top_p")) out["top_p"] = 0.95;
  if (const json* v = given("seed"); v != nullptr && v->is_number_integer() && v->get<int64_t>() == -1) out.erase("seed");
  *until_context = true;
  if (const json* v = given("n_predict")) {
    if (!IntegerIn(*v, -1, std::numeric_limits<int32_t>::max()) || v->get<int64_t>() == 0) {
      fail("n_predict", "'n_predict' must be -1 (until the context ends) or a positive integer");
    }
    if (v->get<int64_t>() > 0) {
      out["max_tokens"] = *v;
      *until_context = false;
    }
  }
  if (const json* v = given("n_probs")) {
    if (!IntegerIn(*v, 0, 20)) fail("n_probs", "'n_probs' must be an integer in [0, 20]");
    if (v->get<int64_t>() > 0) out["logprobs"] = *v;
  }
  if (const json* v = given("repeat_penalty")) out["repetition_penalty"] = *v;
  if (const json* v = given("cache_prompt"); v != nullptr && !v->is_boolean()) fail("cache_prompt", "'cache_prompt' must be a boolean");
  if (const json* v = given("logit_bias")) {
    // [[id, bias], ...] (bias false: never) or OpenAI's object.
    if (v->is_array()) {
      json obj = json::object();
      for (const json& pair : *v) {
        if (!pair.is_array() || pair.size() != 2 || !pair[0].is_number_integer() ||
            !(pair[1].is_number() || pair[1] == false)) {
          fail("logit_bias", "'logit_bias' must be [[token id, bias or false], ...] or {\"id\": bias}");
        }
        obj[std::to_string(pair[0].get<int64_t>())] = pair[1] == false ? json(-100) : pair[1];
      }
      out["logit_bias"] = std::move(obj);
    } else {
      out["logit_bias"] = *v;
    }
  }
  // llama-server's samplers that PageKV does not have: refused unless off.
  const std::vector<std::pair<const char*, double>> off = {
      {"min_p", 0.0}, {"typical_p", 1.0}, {"mirostat", 0}, {"dynatemp_range", 0.0}, {"xtc_probability", 0.0},
      {"dry_multiplier", 0.0}, {"top_n_sigma", -1.0}};
  for (const auto& [name, value] : off) {
    if (const json* v = given(name); v != nullptr && !(v->is_number() && v->get<double>() == value)) {
      fail(name, std::string("'") + name + "' is not supported (leave it at its default)", "unsupported_parameter");
    }
  }
  for (const char* name : {"grammar", "json_schema", "image_data", "lora"}) {
    if (const json* v = given(name); v != nullptr && !(v->is_string() && v->get<std::string>().empty()) &&
                                    !(v->is_array() && v->empty()) && !(v->is_object() && v->empty())) {
      fail(name, std::string("'") + name + "' is not supported", "unsupported_parameter");
    }
  }
  return out;
}

ParsedRequest ParseRequest(const json& body, const RequestText& engine, const std::string& key_salt, bool chat,
                           bool until_context) {
  ParsedRequest out;
  bool& stream = out.stream;
  bool& own_salt = out.own_salt;
  auto field = [&](const char* name) -> const json* { return body.contains(name) && !body[name].is_null() ? &body[name] : nullptr; };
  auto fail = [](const std::string& f, const std::string& m) { throw FieldError{f, m}; };
  if (const json* m = field("model")) {
    if (!m->is_string()) fail("model", "'model' must be a string");
  }
  // Before any tokenizing: a text longer than the context could hold even
  // at the longest token is refused from its size alone.
  const auto fits = [&](const char* name, size_t bytes) {
    const uint64_t most = static_cast<uint64_t>(engine.context_len()) * static_cast<uint64_t>(engine.max_token_bytes());
    if (bytes > most) {
      std::string m = name;
      m.append(" has ").append(std::to_string(bytes)).append(" bytes: more than the model's context of ");
      m.append(std::to_string(engine.context_len())).append(" tokens can hold (at most ").append(std::to_string(most));
      m.append(" bytes at ").append(std::to_string(engine.max_token_bytes())).append(" per token)");
      throw FieldError{name, m, "context_length_exceeded"};
    }
  };
  RefuseUnsupported(body);
  int n = 1;
  if (const json* v = field("n")) {
    if (!IntegerIn(*v, 1, kMaxChoices)) fail("n", "'n' must be an integer in [1, " + std::to_string(kMaxChoices) + "]");
    n = static_cast<int>(v->get<int64_t>());
  }
  bool echo = false;
  if (const json* v = field("echo")) {
    if (chat) fail("echo", "'echo' is a completions parameter");
    if (!v->is_boolean()) fail("echo", "'echo' must be a boolean");
    echo = v->get<bool>();
  }
  // Log-probabilities: completions "logprobs": k (k alternatives per token);
  // chat "logprobs": true with "top_logprobs": k.
  constexpr int kMaxTopLogprobs = 20;
  const std::string top_range = "[0, " + std::to_string(kMaxTopLogprobs) + "]";
  if (const json* v = field("logprobs")) {
    if (chat) {
      if (!v->is_boolean()) fail("logprobs", "'logprobs' must be a boolean");
      if (v->get<bool>()) out.logprobs = 0;
    } else {
      if (!IntegerIn(*v, 0, kMaxTopLogprobs)) fail("logprobs", "'logprobs' must be an integer in " + top_range);
      out.logprobs = static_cast<int>(v->get<int64_t>());
    }
  }
  if (const json* v = field("top_logprobs")) {
    if (!chat) fail("top_logprobs", "'top_logprobs' is a chat parameter: completions take 'logprobs': k");
    if (!IntegerIn(*v, 0, kMaxTopLogprobs)) fail("top_logprobs", "'top_logprobs' must be an integer in " + top_range);
    if (out.logprobs < 0 && v->get<int64_t>() > 0) fail("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    if (out.logprobs >= 0) out.logprobs = static_cast<int>(v->get<int64_t>());
  }
  if (out.logprobs >= 0 && echo) {
    throw FieldError{"echo", "'echo' with 'logprobs' (the prompt's log-probabilities) is not supported yet", "unsupported_parameter"};
  }
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> prompt_texts;
  EngineRequest r;
  if (chat) {
    const json* messages = field("messages");
    if (messages == nullptr || !messages->is_array() || messages->empty()) fail("messages", "'messages' must be a non-empty array");
    // Content as OpenAI sends it: a string, an array of parts (their text
    // joined), or null (an assistant turn that only called tools). The
    // template sees each message with a string content.
    json normalized = json::array();
    size_t bytes = 0;
    for (const json& msg : *messages) {
      if (!msg.is_object() || !msg.contains("role") || !msg["role"].is_string()) {
        fail("messages", "every message needs a string 'role'");
      }
      json m = msg;
      const json* content = msg.contains("content") ? &msg["content"] : nullptr;
      if (content == nullptr || content->is_null()) {
        if (msg["role"] != "assistant") fail("messages", "only an assistant message may have no 'content'");
        m["content"] = "";
      } else if (content->is_array()) {
        std::string text;
        for (const json& part : *content) {
          if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
            fail("messages", "every content part needs a string 'type'");
          }
          if (part["type"] != "text") {
            fail("messages", "content parts of type '" + part["type"].get<std::string>() +
                                 "' are not supported (this model reads text): send 'text' parts only");
          }
          if (!part.contains("text") || !part["text"].is_string()) fail("messages", "a 'text' part needs a string 'text'");
          text += part["text"].get_ref<const std::string&>();
        }
        m["content"] = std::move(text);
      } else if (!content->is_string()) {
        fail("messages", "a message's 'content' must be a string, an array of text parts, or null");
      }
      bytes += m["content"].get_ref<const std::string&>().size();
      normalized.push_back(std::move(m));
    }
    fits("messages", bytes);
    std::string tools;
    if (const json* t = field("tools")) {
      if (!t->is_array()) fail("tools", "'tools' must be an array");
      tools = t->dump();
    }
    // The model's chat template, rendered over the messages as they came.
    Result<std::vector<int32_t>> ids = engine.EncodeChat(normalized.dump(), /*add_generation_prompt=*/true, tools);
    if (!ids.ok()) fail("messages", ids.status().message());
    prompts.push_back(std::move(*ids));
  } else {
    const json* p = field("prompt");
    if (p == nullptr) fail("prompt", "'prompt' is required");
    auto ids_of = [&](const json& list) {
      std::vector<int32_t> ids;
      for (const json& t : list) {
        if (!IntegerIn(t, 0, std::numeric_limits<int32_t>::max())) {
          fail("prompt", "token id " + t.dump() + " in 'prompt' is outside [0, " + std::to_string(std::numeric_limits<int32_t>::max()) + "]");
        }
        ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
      }
      return ids;
    };
    auto is_ids = [](const json& v) {
      return v.is_array() && !v.empty() && std::all_of(v.begin(), v.end(), [](const json& t) { return t.is_number_integer(); });
    };
    // A string, token ids, or a list of either (several prompts).
    std::vector<const json*> items;
    if (p->is_string() || is_ids(*p)) {
      items.push_back(p);
    } else if (p->is_array() && !p->empty() &&
               std::all_of(p->begin(), p->end(), [&](const json& x) { return x.is_string() || is_ids(x); })) {
      for (const json& x : *p) items.push_back(&x);
    } else {
      fail("prompt", "'prompt' must be a string, an array of token ids, or a non-empty array of those");
    }
    if (items.size() > static_cast<size_t>(kMaxChoices)) {
      fail("prompt", "at most " + std::to_string(kMaxChoices) + " prompts in one request");
    }
    size_t bytes = 0;
    for (const json* x : items) bytes = std::max(bytes, x->is_string() ? x->get_ref<const std::string&>().size() : size_t{0});
    fits("prompt", bytes);
    for (const json* x : items) prompts.push_back(x->is_string() ? engine.Encode(x->get<std::string>()) : ids_of(*x));
    for (size_t i = 0; echo && i < items.size(); ++i) {
      prompt_texts.push_back(items[i]->is_string() ? items[i]->get<std::string>() : engine.Detokenize(prompts[i]));
    }
  }
  const char* max_name = chat && field("max_completion_tokens") != nullptr ? "max_completion_tokens" : "max_tokens";
  if (const json* v = field(max_name)) {
    if (!IntegerIn(*v, 1, std::numeric_limits<int32_t>::max())) {
      fail(max_name, std::string("'") + max_name + "' must be a positive integer (at most " +
                         std::to_string(std::numeric_limits<int32_t>::max()) + ")");
    }
    r.max_tokens = static_cast<int32_t>(v->get<int64_t>());
  } else if (chat || until_context) {
    // A chat without a limit runs until the turn ends or the context does.
    r.max_tokens = static_cast<int32_t>(std::max<int64_t>(1, engine.context_len() - static_cast<int64_t>(prompts[0].size())));
  } else {
    r.max_tokens = 16;  // OpenAI's completions default
  }
  r.sampling.temperature = 1.0f;  // OpenAI's default
  if (const json* v = field("temperature")) {
    if (!v->is_number() || !std::isfinite(v->get<double>()) || v->get<double>() < 0 || v->get<double>() > 1e4) {
      fail("temperature", "'temperature' must be a number in [0, 10000]");
    }
    r.sampling.temperature = v->get<float>();
  }
  if (const json* v = field("top_p")) {
    if (!v->is_number() || !(v->get<double>() > 0) || v->get<double>() > 1) fail("top_p", "'top_p' must be in (0, 1]");
    r.sampling.top_p = v->get<float>();
  }
  if (const json* v = field("top_k")) {
    if (!IntegerIn(*v, 0, std::numeric_limits<int32_t>::max())) {
      fail("top_k", "'top_k' must be an integer in [0, " + std::to_string(std::numeric_limits<int32_t>::max()) + "]");
    }
    r.sampling.top_k = static_cast<int32_t>(v->get<int64_t>());
  }
  if (const json* v = field("repetition_penalty")) {  // an extension (vLLM's, llama.cpp's): > 1 discourages repeats
    if (!v->is_number() || !(v->get<double>() >= 1) || v->get<double>() > 10) {
      fail("repetition_penalty", "'repetition_penalty' must be a number in [1, 10] (1: off)");
    }
    r.sampling.repetition_penalty = v->get<float>();
  }
  for (const char* name : {"presence_penalty", "frequency_penalty"}) {
    if (const json* v = field(name)) {
      if (!v->is_number() || !(v->get<double>() >= -2) || v->get<double>() > 2) {
        fail(name, std::string("'") + name + "' must be a number in [-2, 2]");
      }
      (name[0] == 'p' ? r.sampling.presence_penalty : r.sampling.frequency_penalty) = v->get<float>();
    }
  }
  if (const json* v = field("logit_bias")) {
    // {"token id": bias}, as OpenAI: ids as decimal strings, biases in [-100, 100].
    if (!v->is_object() || v->size() > 1024) fail("logit_bias", "'logit_bias' must be an object of at most 1024 entries");
    for (const auto& [key, bias] : v->items()) {
      const bool digits = !key.empty() && key.size() <= 10 && std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
      const int64_t id = digits ? std::stoll(key) : -1;
      if (id < 0 || id >= engine.vocab_size()) {
        fail("logit_bias", "'logit_bias' keys must be token ids in [0, " + std::to_string(engine.vocab_size()) +
                               ") as decimal strings; got '" + key + "'");
      }
      if (!bias.is_number() || !(bias.get<double>() >= -100) || bias.get<double>() > 100) {
        fail("logit_bias", "'logit_bias' values must be numbers in [-100, 100]; token " + key + " has " + bias.dump());
      }
      r.sampling.logit_bias.emplace_back(static_cast<int32_t>(id), bias.get<float>());
    }
  }
  if (const json* v = field("seed")) {
    if (!v->is_number_integer()) fail("seed", "'seed' must be an integer");
    // Negative seeds as two's complement, as OpenAI's int64 ones; large unsigned ones as they are.
    r.sampling.seed = v->is_number_unsigned() ? v->get<uint64_t>() : static_cast<uint64_t>(v->get<int64_t>());
  }
  if (const json* v = field("stop")) {
    if (v->is_string() && !v->get<std::string>().empty()) {
      r.stop.push_back(v->get<std::string>());
    } else if (v->is_array() && v->size() <= 4 && std::all_of(v->begin(), v->end(), [](const json& s) { return s.is_string() && !s.get<std::string>().empty(); })) {
      for (const json& s : *v) r.stop.push_back(s.get<std::string>());
    } else {
      fail("stop", "'stop' must be a non-empty string or an array of at most 4 non-empty strings");
    }
  }
  if (const json* v = field("ignore_eos")) {
    if (!v->is_boolean()) fail("ignore_eos", "'ignore_eos' must be a boolean");
    r.ignore_eos = v->get<bool>();
  }
  stream = false;
  if (const json* v = field("stream")) {
    if (!v->is_boolean()) fail("stream", "'stream' must be a boolean");
    stream = v->get<bool>();
  }
  // The tenant: the key's salt, and within it the request's own.
  own_salt = false;
  std::string salt = key_salt;
  if (const json* v = field("cache_salt")) {
    if (!v->is_string() || v->get<std::string>().empty() || v->get<std::string>().size() > 256) {
      fail("cache_salt", "'cache_salt' must be a string of 1 to 256 bytes");
    }
    const std::array<unsigned char, 32> d = Sha256(salt + '\0', v->get<std::string>());
    salt.assign(reinterpret_cast<const char*>(d.data()), 16);
    own_salt = true;
  }
  if (!salt.empty()) r.extra.cache_salt = salt;
  if (const json* v = field("stream_options")) {
    if (!v->is_object()) fail("stream_options", "'stream_options' must be an object");
    if (v->contains("include_usage") && !(*v)["include_usage"].is_null()) {
      if (!(*v)["include_usage"].is_boolean()) fail("stream_options", "'stream_options.include_usage' must be a boolean");
      out.include_usage = (*v)["include_usage"].get<bool>();
    }
  }
  if (out.logprobs >= 0) {
    r.logprobs = true;
    r.top_logits = out.logprobs;
  }
  if (prompts.size() * static_cast<size_t>(n) > static_cast<size_t>(kMaxChoices)) {
    fail("n", "prompts x n is " + std::to_string(prompts.size() * static_cast<size_t>(n)) + "; at most " +
                  std::to_string(kMaxChoices) + " choices in one request");
  }
  out.n = n;
  for (size_t pi = 0; pi < prompts.size(); ++pi) {
    for (int j = 0; j < n; ++j) {
      EngineRequest c = r;
      c.prompt = prompts[pi];
      if (c.sampling.seed && n > 1) *c.sampling.seed += static_cast<uint64_t>(j);  // choices differ, reproducibly
      out.choices.push_back(std::move(c));
      out.echo.push_back(echo ? prompt_texts[pi] : std::string());
    }
  }
  return out;
}

std::string TenantSalt(const std::string& api_key) {
  const std::array<unsigned char, 32> salt = Sha256("pagekv tenant salt:", api_key);
  return std::string(reinterpret_cast<const char*>(salt.data()), 16);
}

}  // namespace pagekv::server
