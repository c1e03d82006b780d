// `pagekv route` end to end: two real `pagekv serve` processes (stories260K)
// publishing KV events, the real router in front of them, a real HTTP
// client. Two conversations start on different backends (nothing cached:
// in turn); each one's next turns go to the backend holding its earlier turns
// (the backend reports those tokens cached, and the router predicted
// exactly that), and every answer equals a single server's. Then the holder
// of one conversation is killed: its next turn is answered by the other
// backend, with the same text.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

namespace {

using json = nlohmann::json;
constexpr const char* kModel = "../shared/models/stories260K/stories260K.gguf";

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

// A `pagekv <command>` child process; the port is read from its first line
// ("... listening on http://127.0.0.1:PORT ...").
class Child {
 public:
  explicit Child(std::vector<std::string> args) {
    int out[2];
    EXPECT_EQ(pipe(out), 0);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], 1);
      close(out[0]);
      args.insert(args.begin(), PAGEKV_CLI_PATH);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    out_ = fdopen(out[0], "r");
    char line[512] = {};
    while (fgets(line, sizeof(line), out_) != nullptr) {
      const std::string s(line);
      const size_t at = s.find("listening on http://");
      if (at == std::string::npos) continue;
      const size_t colon = s.find(':', at + 20);
      port_ = std::atoi(s.c_str() + colon + 1);
      break;
    }
  }
  ~Child() {
    Kill();
    if (out_ != nullptr) fclose(out_);
  }
  void Kill() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  int port() const { return port_; }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  int port_ = 0;
};

struct Answer {
  std::string text;
  int64_t cached = -1;
};

Answer Chat(int port, const json& messages) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(60, 0);
  const json body = {{"messages", messages}, {"max_tokens", 12}, {"temperature", 0}};
  auto res = cli.Post("/v1/chat/completions", body.dump(), "application/json");
  EXPECT_TRUE(res) << httplib::to_string(res.error());
  if (!res) return {};
  EXPECT_EQ(res->status, 200) << res->body;
  const json j = json::parse(res->body, nullptr, false);
  if (j.is_discarded() || !j.contains("choices")) return {};
  return {j["choices"][0]["message"]["content"].get<std::string>(),
          j["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>()};
}

double Metric(int port, const std::string& series) {
  httplib::Client cli("127.0.0.1", port);
  auto res = cli.Get("/metrics");
  if (!res) return -1;
  // "series value" or "series{labels} value", at a line's start.
  const std::string& t = res->body;
  for (size_t at = t.find("\n" + series); at != std::string::npos; at = t.find("\n" + series, at + 1)) {
    const char next = t[at + 1 + series.size()];
    if (next != ' ' && next != '{') continue;
    const size_t eol = t.find('\n', at + 1);
    const size_t space = t.rfind(' ', eol);
    return std::strtod(t.c_str() + space + 1, nullptr);
  }
  return -1;
}

TEST(RouteTest, ConversationsFollowTheirKvAndAnswerAsOneServerWould) {
  const int ev1 = FreePort(), ev2 = FreePort();
  const std::vector<std::string> common = {"serve", "--model", kModel, "--port", "0", "--blocks", "400",
                                           "--report-cached-tokens", "--threads", "1"};
  auto serve = [&](int events) {
    std::vector<std::string> a = common;
    a.push_back("--kv-events-endpoint");
    a.push_back("tcp://127.0.0.1:" + std::to_string(events));
    return std::make_unique<Child>(a);
  };
  auto b1 = serve(ev1), b2 = serve(ev2);
  Child single(common);
  ASSERT_GT(b1->port(), 0);
  ASSERT_GT(b2->port(), 0);
  ASSERT_GT(single.port(), 0);
  const std::string u1 = "http://127.0.0.1:" + std::to_string(b1->port());
  const std::string u2 = "http://127.0.0.1:" + std::to_string(b2->port());
  Child router({"route", "--model", kModel, "--port", "0", "--health-interval", "0.1", "--backend",
                u1 + ",tcp://127.0.0.1:" + std::to_string(ev1), "--backend", u2 + ",tcp://127.0.0.1:" + std::to_string(ev2)});
  ASSERT_GT(router.port(), 0);
  // Both backends up, and the event subscriptions in place.
  for (int i = 0; i < 100; ++i) {
    httplib::Client cli("127.0.0.1", router.port());
    auto m = cli.Get("/metrics");
    if (m && m->body.find("pagekv_router_backend_up{backend=\"" + u1 + "\"} 1") != std::string::npos &&
        m->body.find("pagekv_router_backend_up{backend=\"" + u2 + "\"} 1") != std::string::npos) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));

  // Two conversations, three turns each, one after the other, through the
  // router and through one server (round-robin would send each turn
  // elsewhere).
  const std::vector<std::vector<std::string>> users = {
      {"Once upon a time there was a little girl named Lily who loved flowers.", "What did she do next?", "And then?"},
      {"Tom had a big red ball and a small dog called Max.", "Where did they go?", "What happened after?"}};
  std::vector<json> routed(2, json::array()), direct(2, json::array());
  std::vector<int> holder(2, -1);
  auto requests_on = [&](int backend_port) { return Metric(backend_port, "vllm:prompt_tokens_total"); };
  for (int c = 0; c < 2; ++c) {
    for (int turn = 0; turn < 3; ++turn) {
      routed[c].push_back({{"role", "user"}, {"content", users[c][turn]}});
      direct[c].push_back({{"role", "user"}, {"content", users[c][turn]}});
      const double before1 = requests_on(b1->port()), before2 = requests_on(b2->port());
      const Answer got = Chat(router.port(), routed[c]);
      const Answer want = Chat(single.port(), direct[c]);
      EXPECT_EQ(got.text, want.text) << "conversation " << c << " turn " << turn;
      const int served = requests_on(b1->port()) > before1 ? 0 : requests_on(b2->port()) > before2 ? 1 : -1;
      ASSERT_GE(served, 0) << "conversation " << c << " turn " << turn << ": no backend counted it";
      if (turn == 0) {
        holder[c] = served;
      } else {
        EXPECT_EQ(served, holder[c]) << "conversation " << c << " turn " << turn << " left the backend holding its KV";
        EXPECT_GT(got.cached, 0) << "conversation " << c << " turn " << turn;
        EXPECT_EQ(got.cached, want.cached) << "the same hit as on one server";
      }
      routed[c].push_back({{"role", "assistant"}, {"content", got.text}});
      direct[c].push_back({{"role", "assistant"}, {"content", want.text}});
      // The events of this turn reach the router before the next one.
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  EXPECT_NE(holder[0], holder[1]) << "new conversations spread over the backends";
  EXPECT_EQ(Metric(router.port(), "pagekv_router_reported_decisions_total"), 6);
  EXPECT_EQ(Metric(router.port(), "pagekv_router_exact_predictions_total"), 6) << "predicted hits equal the reported ones";

  // A body nested 200,000 levels deep is the router's own 400 (its parsed
  // messages would recurse once per level), and the router lives on.
  {
    const std::string deep = std::string(200000, '[') + std::string(200000, ']');
    httplib::Client cli("127.0.0.1", router.port());
    auto r = cli.Post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi","x":)" + deep + "}]}",
                      "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400);
    EXPECT_NE(r->body.find("more than 128 levels deep"), std::string::npos) << r->body;
    EXPECT_EQ(cli.Get("/health")->status, 200);
  }

  // The holder of conversation 0 dies: its next turn goes to the other
  // backend (nothing cached there), with the same answer.
  (holder[0] == 0 ? b1 : b2)->Kill();
  routed[0].push_back({{"role", "user"}, {"content", "The end."}});
  direct[0].push_back({{"role", "user"}, {"content", "The end."}});
  const Answer after = Chat(router.port(), routed[0]);
  const Answer want = Chat(single.port(), direct[0]);
  EXPECT_EQ(after.text, want.text);
  EXPECT_EQ(after.cached, 0);
}

}  // namespace
