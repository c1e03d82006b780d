// `pagekv serve` end to end: the real server process on a free loopback
// port with stories260K, a real HTTP client. 16 concurrent requests (half
// streaming) must equal `pagekv generate` for the same prompt; then the error
// cases, a client that disconnects mid-stream, /metrics as Prometheus text,
// and SIGTERM ending in a clean exit.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "testing/loopback_client.h"
#include "testing/models.h"
#include "testing/redis_server.h"

namespace {

using json = nlohmann::json;
constexpr const char* kModel = "../shared/models/stories260K/stories260K.gguf";

// A `pagekv serve` child process; the port is read from its first line.
class Server {
 public:
  explicit Server(const std::vector<std::string>& extra, const std::string& model = kModel) {
    int out[2];
    EXPECT_EQ(pipe(out), 0);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], 1);
      close(out[0]);
      std::vector<std::string> args = {PAGEKV_CLI_PATH, "serve", "--model", model, "--port", "0"};
      args.insert(args.end(), extra.begin(), extra.end());
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    out_ = fdopen(out[0], "r");
    char line[256] = {};
    if (fgets(line, sizeof(line), out_) != nullptr) {
      const std::string s(line);
      port_ = std::atoi(s.substr(s.rfind(':') + 1).c_str());
    }
  }
  ~Server() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ != nullptr) fclose(out_);
  }
  int port() const { return port_; }
  // SIGTERM, then the exit code.
  int Terminate() {
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  int port_ = 0;
};

std::string GenerateText(const std::string& prompt, int n) {
  const std::string cmd = std::string(PAGEKV_CLI_PATH) + " generate --model " + kModel + " --prompt '" + prompt +
                          "' -n " + std::to_string(n) + " --json";
  FILE* p = popen(cmd.c_str(), "r");
  char buf[65536];
  const size_t got = fread(buf, 1, sizeof(buf), p);
  pclose(p);
  const json first = json::parse(std::string(buf, got).substr(0, std::string(buf, got).find('\n')));
  return first["text"].get<std::string>().substr(prompt.size());
}

const std::vector<std::string> kPrompts = {"Once upon a time", "The little cat", "Lily and Ben", "One day, a boy",
                                           "Tom had a red ball", "The sun was", "Sara found a", "A big dog"};

TEST(ServeTest, ConcurrentRequestsMatchGenerateThenErrorsMetricsAndACleanExit) {
  Server server({"--api-key", "secret", "--max-body-bytes", "4096", "--max-queue", "32"});
  ASSERT_GT(server.port(), 0);
  httplib::Headers auth = {{"Authorization", "Bearer secret"}};
  std::vector<std::string> want;
  for (const std::string& p : kPrompts) want.push_back(GenerateText(p, 24));

  std::vector<std::string> got(16);
  std::vector<std::thread> clients;
  for (int i = 0; i < 16; ++i) {
    clients.emplace_back([&, i] {
      httplib::Client cli("127.0.0.1", server.port());
      cli.set_read_timeout(60, 0);
      const bool stream = i % 2 == 1;
      json body = {{"model", "stories260K.gguf"}, {"prompt", kPrompts[static_cast<size_t>(i) % kPrompts.size()]},
                   {"max_tokens", 24}, {"temperature", 0}, {"ignore_eos", true}, {"stream", stream}};
      auto res = cli.Post("/v1/completions", auth, body.dump(), "application/json");
      ASSERT_TRUE(res) << "request " << i << ": " << httplib::to_string(res.error());
      ASSERT_EQ(res->status, 200) << res->body;
      if (!stream) {
        const json r = json::parse(res->body);
        got[static_cast<size_t>(i)] = r["choices"][0]["text"].get<std::string>();
        EXPECT_EQ(r["usage"]["completion_tokens"], 24);
        EXPECT_TRUE(r["usage"]["prompt_tokens_details"].contains("cached_tokens"));
        return;
      }
      std::istringstream lines(res->body);
      std::string line, text;
      bool done = false;
      while (std::getline(lines, line)) {
        if (line.rfind("data: ", 0) != 0) continue;
        if (line == "data: [DONE]") {
          done = true;
          break;
        }
        text += json::parse(line.substr(6))["choices"][0]["text"].get<std::string>();
      }
      EXPECT_TRUE(done);
      got[static_cast<size_t>(i)] = text;
    });
  }
  for (auto& t : clients) t.join();
  for (int i = 0; i < 16; ++i) EXPECT_EQ(got[static_cast<size_t>(i)], want[static_cast<size_t>(i) % kPrompts.size()]) << i;

  httplib::Client cli("127.0.0.1", server.port());
  cli.set_read_timeout(30, 0);
  auto post = [&](const std::string& path, const std::string& body, const httplib::Headers& h) {
    return cli.Post(path.c_str(), h, body, "application/json");
  };
  // Chat works too.
  auto chat = post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"Once upon a time"}],"max_tokens":4})", auth);
  ASSERT_TRUE(chat);
  EXPECT_EQ(chat->status, 200);
  EXPECT_EQ(json::parse(chat->body)["choices"][0]["message"]["role"], "assistant");
  // Errors.
  struct Case {
    std::string body;
    int status;
    std::string needle;
  };
  for (const Case& c : std::vector<Case>{
           {"{not json", 400, "malformed JSON"},
           {R"({"max_tokens": 4})", 400, "'prompt' is required"},
           {R"({"prompt": "hi", "max_tokens": "many"})", 400, "max_tokens"},
           {R"({"prompt": "hi", "model": "gpt-9"})", 404, "gpt-9"},
           {R"({"prompt": "hi", "max_tokens": 5000})", 400, "context of 2048"},
           {"{\"prompt\": \"" + std::string(5000, 'a') + "\"}", 413, "max-body-bytes"},
           // Numbers out of range are named, never wrapped or thrown.
           {R"({"prompt": [1, 4294967297], "max_tokens": 2})", 400, "token id 4294967297"},
           {R"({"prompt": "hi", "top_k": 4294967299})", 400, "top_k"},
           {R"({"prompt": "hi", "max_tokens": 18446744073709551615})", 400, "max_tokens"},
           {R"({"prompt": "hi", "temperature": 1e400})", 400, "malformed JSON"},
           {R"({"prompt": "hi", "temperature": 1e300})", 400, "temperature"},
           {R"({"prompt": "hi", "stop": ""})", 400, "stop"},
           {"{\"prompt\": \"hi\", \"model\": \"\xff\xfe\"}", 400, "malformed JSON"},
       }) {
    auto r = post("/v1/completions", c.body, auth);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, c.status) << c.body.substr(0, 40) << ": " << r->body;
    EXPECT_NE(r->body.find(c.needle), std::string::npos) << r->body;
    EXPECT_FALSE(json::parse(r->body, nullptr, false).is_discarded()) << "not a JSON body: " << r->body;
    EXPECT_FALSE(r->has_header("EXCEPTION_WHAT"));
  }
  auto unauth = post("/v1/completions", R"({"prompt":"hi"})", {{"Authorization", "Bearer wrong"}});
  ASSERT_TRUE(unauth);
  EXPECT_EQ(unauth->status, 401);
  // A client that goes away mid-stream: its request is cancelled and frees its blocks.
  {
    httplib::Client quitter("127.0.0.1", server.port());
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.headers = auth;
    req.body = R"({"prompt":"Once upon a time","max_tokens":1500,"ignore_eos":true,"stream":true})";
    req.set_header("Content-Type", "application/json");
    int chunks = 0;
    req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 3; };
    quitter.send(req);
    EXPECT_GE(chunks, 3);
  }
  // /metrics: Prometheus text; eventually no block in use.
  // One sample line: name{label="v",...} value (no std::regex: GCC 12
  // warns about its internals under the sanitizer build's -Werror).
  auto is_sample = [](const std::string& line) {
    size_t i = 0;
    auto name_char = [](char c, bool first) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':' || (!first && std::isdigit(static_cast<unsigned char>(c))); };
    if (line.empty() || !name_char(line[0], true)) return false;
    while (i < line.size() && name_char(line[i], i == 0)) ++i;
    if (i < line.size() && line[i] == '{') {
      const size_t close = line.find('}', i);
      if (close == std::string::npos) return false;
      const std::string labels = line.substr(i + 1, close - i - 1);
      if (labels.find('=') == std::string::npos || std::count(labels.begin(), labels.end(), '"') % 2 != 0) return false;
      i = close + 1;
    }
    if (i >= line.size() || line[i] != ' ') return false;
    const std::string value = line.substr(i + 1);
    if (value == "+Inf" || value == "NaN") return true;
    char* end = nullptr;
    std::strtod(value.c_str(), &end);
    return !value.empty() && *end == '\0';
  };
  bool drained = false;
  for (int attempt = 0; attempt < 100 && !drained; ++attempt) {
    auto m = cli.Get("/metrics");
    ASSERT_TRUE(m);
    ASSERT_EQ(m->status, 200);
    std::istringstream lines(m->body);
    std::string line;
    int samples = 0;
    while (std::getline(lines, line)) {
      if (line.empty() || line[0] == '#') continue;
      EXPECT_TRUE(is_sample(line)) << line;
      ++samples;
      if (line.rfind("pagekv_kv_blocks{", 0) == 0 && line.find(",state=\"used\"} 0") != std::string::npos) drained = true;
    }
    EXPECT_GT(samples, 10);
    EXPECT_NE(m->body.find("vllm:time_to_first_token_seconds_bucket"), std::string::npos);
    if (!drained) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(drained) << "the disconnected stream's blocks were not freed";
  auto models = cli.Get("/v1/models", auth);
  ASSERT_TRUE(models);
  EXPECT_EQ(json::parse(models->body)["data"][0]["id"], "stories260K.gguf");
  EXPECT_EQ(cli.Get("/health")->status, 200);
  EXPECT_EQ(server.Terminate(), 0);
}

TEST(ServeTest, AFullQueueAnswers429WithRetryAfter) {
  Server server({"--max-queue", "1"});
  ASSERT_GT(server.port(), 0);
  // A long stream holds the one queue place; while its first chunk is being
  // read, a second request is refused.
  httplib::Client streaming("127.0.0.1", server.port());
  streaming.set_read_timeout(60, 0);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = R"({"prompt":"Once upon a time","max_tokens":2000,"ignore_eos":true,"stream":true})";
  req.set_header("Content-Type", "application/json");
  int second_status = 0;
  std::string retry_after;
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
    if (second_status == 0) {
      httplib::Client cli("127.0.0.1", server.port());
      auto r = cli.Post("/v1/completions", R"({"prompt":"hi","max_tokens":2})", "application/json");
      second_status = r ? r->status : -1;
      retry_after = r ? r->get_header_value("Retry-After") : "";
    }
    return false;  // and hang up: the stream is cancelled
  };
  streaming.send(req);
  EXPECT_EQ(second_status, 429);
  EXPECT_EQ(retry_after, "1");
  EXPECT_EQ(server.Terminate(), 0);
}


// One whole UTF-8 character after another (no character cut).
bool WholeUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

// SmolLM2 (a real instruct model with a ChatML template): chat requests
// render the template, end at <|im_end|> when no max_tokens is given, stream
// whole characters, and template or token errors are 400s naming them.
TEST(ServeTest, SmolLM2ChatRendersTheTemplateStopsAtTheTurnAndStreamsWholeCharacters) {
  const std::string model = pagekv::testing::SmolLM2Path();
  struct stat st {};
  ASSERT_EQ(::stat(model.c_str(), &st), 0) << model << " is missing: run scripts/fetch-model.sh (make test does)";
  // A second server whose template raises for a conversation that does not
  // open with a user message.
  const std::string strict = std::filesystem::temp_directory_path() / ("pagekv-strict-" + std::to_string(getpid()) + ".jinja");
  std::ofstream(strict) << "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with "
                           "the user') }}{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                           "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
  Server server({"--kv-budget", "512MiB"}, model);
  Server strict_server({"--chat-template", strict, "--kv-budget", "64MiB"}, model);
  ASSERT_GT(server.port(), 0);
  ASSERT_GT(strict_server.port(), 0);
  httplib::Client cli("127.0.0.1", server.port());
  cli.set_read_timeout(120, 0);
  auto post = [](httplib::Client& c, const std::string& path, const json& body) {
    auto r = c.Post(path.c_str(), body.dump(), "application/json");
    EXPECT_TRUE(r) << httplib::to_string(r.error());
    return r;
  };
  const json question = {{"messages", {{{"role", "user"}, {"content", "What is the capital of France?"}}}},
                         {"temperature", 0}};
  auto res = post(cli, "/v1/chat/completions", question);
  ASSERT_EQ(res->status, 200) << res->body;
  const json answer = json::parse(res->body);
  const std::string content = answer["choices"][0]["message"]["content"];
  EXPECT_NE(content.find("Paris"), std::string::npos) << content;
  EXPECT_EQ(content.find("<|im_end|>"), std::string::npos) << content;
  EXPECT_EQ(answer["choices"][0]["finish_reason"], "stop");
  EXPECT_LT(answer["usage"]["completion_tokens"].get<int>(), 64);
  // The prompt is the template's rendering: the default system message
  // SmolLM2's template adds, the user turn, the assistant's opening.
  EXPECT_GT(answer["usage"]["prompt_tokens"].get<int>(), 30);

  // Streaming: whole characters in every chunk, the same text in all.
  json stream = {{"messages", {{{"role", "user"}, {"content", "Translate 'good morning' into Japanese."}}}},
                 {"temperature", 0}, {"max_tokens", 40}};
  auto whole = post(cli, "/v1/chat/completions", stream);
  ASSERT_EQ(whole->status, 200) << whole->body;
  const std::string want = json::parse(whole->body)["choices"][0]["message"]["content"];
  stream["stream"] = true;
  auto streamed = post(cli, "/v1/chat/completions", stream);
  ASSERT_EQ(streamed->status, 200);
  std::istringstream lines(streamed->body);
  std::string text;
  int chunks = 0, multibyte = 0;
  bool done = false;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: ", 0) != 0) continue;
    if (line == "data: [DONE]") {
      done = true;
      break;
    }
    // The raw bytes of each event are whole characters (the JSON escapes
    // none of them: dump keeps UTF-8).
    EXPECT_TRUE(WholeUtf8(line)) << line;
    const json choice = json::parse(line.substr(6))["choices"][0];
    const json delta = choice["delta"];
    if (!delta.contains("content")) continue;
    const std::string piece = delta["content"];
    EXPECT_TRUE(WholeUtf8(piece));
    // Bytes of a character that never completes become U+FFFD, only where
    // max_tokens cut the answer inside it: the last chunk.
    if (choice["finish_reason"].is_null()) {
      EXPECT_EQ(piece.find("\xEF\xBF\xBD"), std::string::npos) << "a replacement character before the end";
    }
    multibyte += std::any_of(piece.begin(), piece.end(), [](char c) { return (static_cast<unsigned char>(c) & 0x80) != 0; });
    text += piece;
    ++chunks;
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(text, want);
  EXPECT_GT(multibyte, 0) << "the answer was to hold Japanese: " << text;
  EXPECT_GT(chunks, 5);

  // Errors: a template that raises, a message without content, token ids
  // outside the vocabulary.
  httplib::Client strict_cli("127.0.0.1", strict_server.port());
  strict_cli.set_read_timeout(60, 0);
  auto raised = post(strict_cli, "/v1/chat/completions",
                     {{"messages", {{{"role", "system"}, {"content", "Be brief."}}, {{"role", "user"}, {"content", "Hi"}}}},
                      {"max_tokens", 4}});
  EXPECT_EQ(raised->status, 400) << raised->body;
  EXPECT_NE(raised->body.find("Conversations must start with the user"), std::string::npos) << raised->body;
  auto ok = post(strict_cli, "/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"max_tokens", 4}});
  EXPECT_EQ(ok->status, 200) << ok->body;
  auto no_content = post(cli, "/v1/chat/completions", {{"messages", {{{"role", "user"}}}}});
  EXPECT_EQ(no_content->status, 400);
  EXPECT_NE(no_content->body.find("content"), std::string::npos) << no_content->body;
  auto bad_ids = post(cli, "/v1/completions", {{"prompt", {1, 49152}}, {"max_tokens", 2}});
  EXPECT_EQ(bad_ids->status, 400);
  EXPECT_NE(bad_ids->body.find("49152"), std::string::npos) << bad_ids->body;
  EXPECT_EQ(server.Terminate(), 0);
  EXPECT_EQ(strict_server.Terminate(), 0);
  std::remove(strict.c_str());
}

// Two servers at one Redis: a prompt the first computed is a Redis hit for
// the second, with the same completion, counted in /metrics.
// API keys from a file, each its own tenant; usage.cached_tokens goes only
// to a request that brought its own cache_salt, so a client sharing a key
// cannot confirm another's prompt by it.
TEST(ServeTest, KeysFromAFileAreTenantsAndCachedTokensGoOnlyToTheirOwnSalt) {
  const std::string keys = (std::filesystem::temp_directory_path() / ("pagekv-keys-" + std::to_string(getpid()))).string();
  {
    std::ofstream f(keys);
    f << "# tenants\nkey-alpha-0123456789\n\n  key-beta-0123456789  \n";
  }
  std::filesystem::permissions(keys, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write,
                               std::filesystem::perm_options::replace);
  Server server({"--api-key-file", keys, "--block-len", "8"});
  std::filesystem::remove(keys);
  ASSERT_GT(server.port(), 0);
  httplib::Client cli("127.0.0.1", server.port());
  cli.set_read_timeout(60, 0);
  const std::string prompt = "Once upon a time there was a little girl named Lily. She liked to play outside";
  auto cached = [&](const std::string& key, const std::string& salt, int want_status = 200) {
    json body = {{"prompt", prompt}, {"max_tokens", 2}, {"temperature", 0}};
    if (!salt.empty()) body["cache_salt"] = salt;
    auto res = cli.Post("/v1/completions", {{"Authorization", "Bearer " + key}}, body.dump(), "application/json");
    EXPECT_TRUE(res);
    if (!res) return -1;
    EXPECT_EQ(res->status, want_status) << res->body;
    const json r = json::parse(res->body);
    if (res->status != 200) {
      EXPECT_TRUE(r.contains("error")) << res->body;
      return -1;
    }
    return r["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
  };
  EXPECT_EQ(cached("key-alpha-0123456789", ""), 0);
  EXPECT_EQ(cached("key-alpha-0123456789", ""), 0) << "a hit without the request's own salt is not reported";
  EXPECT_EQ(cached("key-alpha-0123456789", "alice"), 0);
  EXPECT_GE(cached("key-alpha-0123456789", "alice"), 16) << "its own salt: reported";
  EXPECT_EQ(cached("key-alpha-0123456789", "bob"), 0) << "another salt shares nothing";
  EXPECT_EQ(cached("key-beta-0123456789", "alice"), 0) << "another key is another tenant, whatever its salt";
  EXPECT_GE(cached("key-beta-0123456789", "alice"), 16);
  cached("key-gamma", "", 401);
  cached("key-alpha-012345678", "", 401);  // a prefix of a key
  cached("key-alpha-0123456789", std::string(257, 's'), 400);
  // A prompt no tokenization could fit in the context: refused from its size, before it is tokenized.
  auto huge = cli.Post("/v1/completions", {{"Authorization", "Bearer key-alpha-0123456789"}},
                       json{{"prompt", std::string(500000, 'a')}}.dump(), "application/json");
  ASSERT_TRUE(huge);
  EXPECT_EQ(huge->status, 400);
  EXPECT_NE(huge->body.find("bytes: more than the model's context"), std::string::npos) << huge->body;
  auto res = cli.Post("/v1/completions", {{"Authorization", "Bearer key-alpha-0123456789"}},
                      R"({"prompt":"hi","cache_salt":7})", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(res->body.find("cache_salt"), std::string::npos) << res->body;
}

TEST(ServeTest, KeyFlagsAreCheckedAndAKeyOnTheCommandLineWarns) {
  auto run = [](const std::string& flags) {
    const std::string cmd = "timeout -k 5 2 " + std::string(PAGEKV_CLI_PATH) + " serve --model " + kModel + " --port 0 " +
                            flags + " 2>&1; echo \"exit=$?\"";
    FILE* p = popen(cmd.c_str(), "r");
    std::string out;
    char buf[4096];
    for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
    pclose(p);
    return out;
  };
  std::string out = run("--api-key-file /dev/zero");
  EXPECT_NE(out.find("not a regular file"), std::string::npos) << out;
  EXPECT_NE(out.find("exit=2"), std::string::npos) << out;
  out = run("--api-key-env PAGEKV_TEST_UNSET_VARIABLE");
  EXPECT_NE(out.find("not set"), std::string::npos) << out;
  EXPECT_NE(out.find("exit=2"), std::string::npos) << out;
  out = run("--api-key on-the-command-line");
  EXPECT_NE(out.find("warning: --api-key shows the key"), std::string::npos) << out;
}

// A body is bounded whatever its encoding: a compressed one is refused
// before it is inflated (a gzip bomb), a chunked one as soon as it passes
// --max-body-bytes, while it is still being sent.
TEST(ServeTest, CompressedAndChunkedBodiesAreBoundedBeforeTheyAreRead) {
  Server server({"--max-body-bytes", "4096"});
  ASSERT_GT(server.port(), 0);
  httplib::Client cli("127.0.0.1", server.port());
  auto gz = cli.Post("/v1/completions", {{"Content-Encoding", "gzip"}}, std::string(64, '\x1f'), "application/json");
  ASSERT_TRUE(gz);
  EXPECT_EQ(gz->status, 415);
  EXPECT_NE(gz->body.find("Content-Encoding"), std::string::npos) << gz->body;
  EXPECT_TRUE(json::parse(gz->body).contains("error"));

  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(server.port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const std::string head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           "Transfer-Encoding: chunked\r\n\r\n";
  ASSERT_EQ(send(fd, head.data(), head.size(), MSG_NOSIGNAL), static_cast<ssize_t>(head.size()));
  // Up to 256 MiB in 64 KiB chunks; the server must answer long before.
  std::atomic<int64_t> sent{0};
  std::thread sender([&] {
    const std::string body(65536, ' ');
    char size_line[32];
    std::snprintf(size_line, sizeof size_line, "%zx\r\n", body.size());
    const std::string chunk = size_line + body + "\r\n";
    for (int i = 0; i < 4096; ++i) {
      if (send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(chunk.size())) return;
      sent += static_cast<int64_t>(chunk.size());
    }
  });
  std::string reply;
  char buf[4096];
  timeval tv{20, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  for (ssize_t n; reply.find("\r\n\r\n") == std::string::npos && (n = recv(fd, buf, sizeof buf, 0)) > 0;) {
    reply.append(buf, static_cast<size_t>(n));
  }
  shutdown(fd, SHUT_RDWR);
  sender.join();
  close(fd);
  EXPECT_EQ(reply.rfind("HTTP/1.1 413", 0), 0u) << reply.substr(0, 200);
  EXPECT_LT(sent.load(), int64_t{64} << 20) << "the whole chunked body was taken in before the answer";
  auto health = cli.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

// Parsed JSON recurses once per level wherever it is copied, dumped or handed
// to the chat template: a 400 KB body of '[' once overflowed the worker's
// stack and took the whole server down.
TEST(ServeTest, DeeplyNestedBodiesAre400sAndTheServerLivesOn) {
  Server server({});
  ASSERT_GT(server.port(), 0);
  httplib::Client cli("127.0.0.1", server.port());
  const size_t d = 200000;
  const std::string deep = std::string(d, '[') + std::string(d, ']');
  const std::vector<std::pair<std::string, std::string>> bodies = {
      {"/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi","x":)" + deep + "}]}"},
      {"/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi"}],"tools":)" + deep + "}"},
      {"/v1/completions", R"({"prompt":"hi","stop":)" + deep + "}"},
      {"/completion", R"({"prompt":)" + deep + "}"},
      {"/tokenize", R"({"content":)" + deep + "}"},
  };
  for (const auto& [path, body] : bodies) {
    auto r = cli.Post(path, body, "application/json");
    ASSERT_TRUE(r) << path;
    EXPECT_EQ(r->status, 400) << path;
    const json e = json::parse(r->body, nullptr, false);
    ASSERT_FALSE(e.is_discarded()) << r->body;
    EXPECT_NE(e["error"]["message"].get<std::string>().find("more than 128 levels deep"), std::string::npos) << r->body;
  }
  // 128 levels are read; the template sees them as they came.
  const std::string ok = std::string(125, '[') + std::string(125, ']');  // 3 + 125 = 128
  auto r = cli.Post("/v1/chat/completions",
                    R"({"messages":[{"role":"user","content":"hi","x":)" + ok + R"(}],"max_tokens":2})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(server.Terminate(), 0);
}

TEST(ServeTest, TwoServersShareAPrefixThroughRedis) {
  pagekv::testing::RedisServer redis;
  ASSERT_TRUE(redis.Start().ok());
  const std::vector<std::string> flags = {"--redis", redis.url(), "--block-len", "8"};
  Server a(flags), b(flags);
  ASSERT_GT(a.port(), 0);
  ASSERT_GT(b.port(), 0);
  const json body = {{"prompt", "Once upon a time there was a little girl named Lily. She liked to play outside"},
                     {"max_tokens", 16}, {"temperature", 0}, {"cache_salt", "one tenant"}};
  auto complete = [&](int port) {
    httplib::Client cli("127.0.0.1", port);
    cli.set_read_timeout(60, 0);
    auto res = cli.Post("/v1/completions", body.dump(), "application/json");
    EXPECT_TRUE(res && res->status == 200);
    return res ? json::parse(res->body) : json{};
  };
  const json first = complete(a.port());
  EXPECT_EQ(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  // Written through in the background: wait until the blocks are there.
  for (int i = 0; i < 250 && std::atoi(redis.Command("DBSIZE")->c_str() + 1) < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const json second = complete(b.port());
  EXPECT_GE(second["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 16) << second.dump();
  EXPECT_EQ(second["choices"][0]["text"], first["choices"][0]["text"]);
  httplib::Client cli("127.0.0.1", b.port());
  auto metrics = cli.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("pagekv_tier_loaded_blocks_total{model_name=\"stories260K.gguf\",tier=\"redis\"} "), std::string::npos);
  EXPECT_EQ(metrics->body.find("pagekv_tier_loaded_blocks_total{model_name=\"stories260K.gguf\",tier=\"redis\"} 0\n"), std::string::npos) << metrics->body;
  EXPECT_NE(metrics->body.find("pagekv_tier_healthy{model_name=\"stories260K.gguf\",tier=\"redis\"} 1"), std::string::npos);
  EXPECT_NE(metrics->body.find("pagekv_tier_unauthenticated_total{model_name=\"stories260K.gguf\",tier=\"redis\"} 0"), std::string::npos);
  EXPECT_EQ(a.Terminate(), 0);
  EXPECT_EQ(b.Terminate(), 0);
}

}  // namespace

namespace transport {

using pagekv::testing::LoopbackClient;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// The value of a sample in Prometheus text, its first series whatever its
// labels (-1 when absent).
double Metric(const std::string& text, const std::string& name) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(name, 0) != 0 || line.size() <= name.size()) continue;
    if (line[name.size()] == ' ') return std::strtod(line.c_str() + name.size() + 1, nullptr);
    if (line[name.size()] == '{') {
      const size_t close = line.find("} ", name.size());
      if (close != std::string::npos) return std::strtod(line.c_str() + close + 2, nullptr);
    }
  }
  return -1;
}

std::string Metrics(int port) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(10, 0);
  auto m = cli.Get("/metrics");
  return m ? m->body : std::string();
}

TEST(ServeTest, SlowClientsCannotDelayHealth) {
  Server server({"--header-timeout", "3"});
  ASSERT_GT(server.port(), 0);
  // 200 connections, each sending one header line a second and never
  // finishing its header (the old server's 64 handler threads all waited on
  // such clients, and /health with them).
  std::vector<std::unique_ptr<LoopbackClient>> slow;
  for (int i = 0; i < 200; ++i) {
    slow.push_back(std::make_unique<LoopbackClient>(server.port()));
    ASSERT_TRUE(slow.back()->connected()) << i;
    ASSERT_TRUE(slow.back()->Send("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")) << i;
  }
  const auto start = Clock::now();
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    for (int round = 0; round < 6 && !stop.load(); ++round) {
      for (auto& c : slow) c->Send("X-Slow-" + std::to_string(round) + ": 1\r\n");
      std::this_thread::sleep_for(1s);
    }
  });
  double worst = 0;
  for (int probe = 0; probe < 12; ++probe) {
    httplib::Client cli("127.0.0.1", server.port());
    cli.set_read_timeout(10, 0);
    const auto t0 = Clock::now();
    auto h = cli.Get("/health");
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    ASSERT_TRUE(h) << "probe " << probe;
    EXPECT_EQ(h->status, 200);
    worst = std::max(worst, s);
    std::this_thread::sleep_for(200ms);
  }
  EXPECT_LT(worst, 1.0) << "200 slow clients delayed /health by " << worst << " s";
  // Their headers' deadline (3 s from the first byte) closes every one.
  int closed = 0;
  for (auto& c : slow) closed += c->ClosedWithin(std::chrono::duration_cast<std::chrono::milliseconds>(start + 8s - Clock::now()) + 100ms) ? 1 : 0;
  stop = true;
  trickle.join();
  EXPECT_EQ(closed, 200);
  EXPECT_GE(Metric(Metrics(server.port()), "pagekv_http_timeouts_total"), 200);
}

TEST(ServeTest, ANonStreamingRequestIsCancelledWhenItsClientGoesAway) {
  Server server({});
  ASSERT_GT(server.port(), 0);
  const std::string body = R"({"prompt":"Once upon a time","max_tokens":1500,"ignore_eos":true})";
  std::vector<std::unique_ptr<LoopbackClient>> clients;
  for (int i = 0; i < 8; ++i) {
    clients.push_back(std::make_unique<LoopbackClient>(server.port()));
    ASSERT_TRUE(clients.back()->Send("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                     "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body));
  }
  for (int i = 0; i < 200 && Metric(Metrics(server.port()), "vllm:generation_tokens_total") <= 0; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  clients.clear();  // every client goes away without waiting for its answer
  std::string m;
  for (int i = 0; i < 200; ++i) {
    m = Metrics(server.port());
    if (Metric(m, "vllm:num_requests_running") == 0 && Metric(m, "vllm:num_requests_waiting") == 0) break;
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(Metric(m, "vllm:num_requests_running"), 0) << "the abandoned requests still decode";
  EXPECT_EQ(Metric(m, "pagekv_http_client_gone_total"), 8) << m;
  EXPECT_LT(Metric(m, "vllm:generation_tokens_total"), 8 * 1500 / 2) << "the abandoned requests ran to their end";
  EXPECT_NE(m.find(",state=\"used\"} 0\n"), std::string::npos) << m;
  EXPECT_EQ(server.Terminate(), 0);
}

TEST(ServeTest, TransportLimitsAnswerWithJsonErrors) {
  Server server({"--max-connections", "4", "--max-headers", "50"});
  ASSERT_GT(server.port(), 0);
  {
    std::string many = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n";
    for (int i = 0; i < 60; ++i) many += "X-H" + std::to_string(i) + ": v\r\n";
    LoopbackClient c(server.port());
    ASSERT_TRUE(c.Send(many + "\r\n"));
    const std::string got = c.Read("}}");
    EXPECT_EQ(got.rfind("HTTP/1.1 431 ", 0), 0u) << got;
    const json e = json::parse(got.substr(got.find("\r\n\r\n") + 4), nullptr, false);
    ASSERT_FALSE(e.is_discarded()) << got;
    EXPECT_EQ(e["error"]["code"], "request_header_fields_too_large");
    EXPECT_NE(e["error"]["message"].get<std::string>().find("61 header fields"), std::string::npos) << got;
  }
  {
    LoopbackClient c(server.port());
    ASSERT_TRUE(c.Send("GET /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"));
    const std::string got = c.Read("}}");
    EXPECT_EQ(got.rfind("HTTP/1.1 405 ", 0), 0u) << got;
    EXPECT_NE(got.find("Allow: POST"), std::string::npos) << got;
  }
  // Four connections the server holds (a header never finished). One that
  // opens while the connections above are still being closed gets a 503
  // itself: it is replaced.
  std::vector<std::unique_ptr<LoopbackClient>> held;
  for (int attempt = 0; attempt < 50 && held.size() < 4; ++attempt) {
    auto c = std::make_unique<LoopbackClient>(server.port());
    ASSERT_TRUE(c->Send("GET /health HTTP/1.1\r\n"));
    if (c->Read("HTTP/", 200ms).empty()) {
      held.push_back(std::move(c));
    } else {
      std::this_thread::sleep_for(100ms);
    }
  }
  ASSERT_EQ(held.size(), 4u);
  LoopbackClient over(server.port());
  const std::string got = over.Read("}}");
  EXPECT_EQ(got.rfind("HTTP/1.1 503 ", 0), 0u) << got;
  EXPECT_NE(got.find("Retry-After: 1"), std::string::npos) << got;
  const json e = json::parse(got.substr(got.find("\r\n\r\n") + 4), nullptr, false);
  ASSERT_FALSE(e.is_discarded()) << got;
  EXPECT_NE(e["error"]["message"].get<std::string>().find("too many connections"), std::string::npos);
  held.clear();
  std::this_thread::sleep_for(300ms);
  EXPECT_GE(Metric(Metrics(server.port()), "pagekv_http_connections_refused_total"), 1);
  EXPECT_EQ(server.Terminate(), 0);
}

}  // namespace transport
