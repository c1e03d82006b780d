// The Redis tier's connections (redis_transport.h): url parsing, one
// connection with timeouts and backoff, and the single-node transport.
#include "tiers/redis_transport.h"

#include <cstdlib>
#include <sstream>

namespace pagekv::tiers {
namespace {

using Clock = std::chrono::steady_clock;

timeval Tv(int ms) { return timeval{ms / 1000, (ms % 1000) * 1000}; }

Result<int> ParsePort(const std::string& port, const std::string& what) {
  char* end = nullptr;
  const long v = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || v < 1 || v > 65535) {
    return InvalidArgumentError(what + ": port '" + port + "' is not in 1..65535");
  }
  return static_cast<int>(v);
}

class SingleNode final : public RedisTransport {
 public:
  SingleNode(const RedisStoreOptions& o, RedisEndpoint e) : conn_(o, std::move(e)) {}

  void Run(std::span<RedisOp> ops) override {
    std::vector<const std::vector<std::string>*> commands;
    for (const RedisOp& op : ops) commands.push_back(&op.argv);
    std::vector<Reply> replies;
    Status status = conn_.Ensure();
    if (status.ok()) conn_.Pipeline(commands, replies, status);
    for (size_t i = 0; i < ops.size(); ++i) {
      if (i < replies.size()) {
        ops[i].reply = std::move(replies[i]);
      } else {
        ops[i].status = status;
      }
    }
  }
  bool healthy() const override { return conn_.healthy(); }
  int64_t errors() const override { return conn_.errors(); }

 private:
  RedisConnection conn_;
};

}  // namespace

Result<RedisEndpoint> ParseRedisUrl(const std::string& url) {
  const std::string scheme = "redis://";
  if (url.find('@') != std::string::npos) {
    // A password in a url shows in `ps`, shell history and logs; the url is
    // not echoed here for the same reason.
    return InvalidArgumentError(
        "the redis url carries credentials ('user:password@'): give the password through RedisStoreOptions::password "
        "(the CLI: --redis-password-env or --redis-password-file) and the url as redis://host[:port][/db]");
  }
  if (url.rfind(scheme, 0) != 0) {
    return InvalidArgumentError("redis url '" + url + "': expected redis://host[:port][/db]");
  }
  RedisEndpoint e;
  std::string rest = url.substr(scheme.size());
  if (const size_t slash = rest.find('/'); slash != std::string::npos) {
    const std::string db = rest.substr(slash + 1);
    rest = rest.substr(0, slash);
    if (!db.empty()) {
      char* end = nullptr;
      const long v = std::strtol(db.c_str(), &end, 10);
      if (*end != '\0' || v < 0 || v > 1000000) return InvalidArgumentError("redis url: database '" + db + "' is not a number");
      e.db = static_cast<int>(v);
    }
  }
  if (const size_t colon = rest.rfind(':'); colon != std::string::npos && rest.find(']') == std::string::npos) {
    PAGEKV_ASSIGN_OR_RETURN(e.port, ParsePort(rest.substr(colon + 1), "redis url"));
    rest = rest.substr(0, colon);
  }
  if (!rest.empty()) e.host = rest;
  return e;
}

Result<std::vector<RedisEndpoint>> ParseClusterNodes(const std::string& list) {
  std::vector<RedisEndpoint> out;
  std::stringstream ss(list);
  for (std::string node; std::getline(ss, node, ',');) {
    if (node.empty()) continue;
    if (node.find('@') != std::string::npos || node.find("://") != std::string::npos) {
      return InvalidArgumentError("redis cluster node '" + node +
                                  "': give host:port (no scheme, no credentials: the password comes from "
                                  "--redis-password-env or --redis-password-file)");
    }
    const size_t colon = node.rfind(':');
    if (colon == std::string::npos || colon == 0) {
      return InvalidArgumentError("redis cluster node '" + node + "': expected host:port");
    }
    RedisEndpoint e;
    e.host = node.substr(0, colon);
    PAGEKV_ASSIGN_OR_RETURN(e.port, ParsePort(node.substr(colon + 1), "redis cluster node '" + node + "'"));
    out.push_back(std::move(e));
  }
  if (out.empty()) return InvalidArgumentError("redis cluster: no nodes given (host:port[,host:port...])");
  return out;
}

RedisConnection::RedisConnection(const RedisStoreOptions& o, RedisEndpoint e) : o_(o), ep_(std::move(e)) {
  backoff_ms_ = o_.backoff_initial_ms;
}

RedisConnection::~RedisConnection() {
  if (ctx_ != nullptr) redisFree(ctx_);
}

Status RedisConnection::Ensure() {
  if (ctx_ != nullptr) return Status::Ok();
  if (Clock::now() < retry_at_) {
    ++errors_;
    return UnavailableError("redis tier: " + name() + " is unhealthy; retrying after a backoff");
  }
  ctx_ = redisConnectWithTimeout(ep_.host.c_str(), ep_.port, Tv(o_.timeout_ms));
  if (ctx_ == nullptr || ctx_->err != 0) return Fail("connect");
  redisSetTimeout(ctx_, Tv(o_.timeout_ms));
  auto check = [&](redisReply* raw, const char* what) -> Status {
    Reply r(raw);
    if (!r) return Fail(what);
    if (r->type == REDIS_REPLY_ERROR) {
      ++errors_;
      const std::string why(r->str, r->len);
      redisFree(ctx_);
      ctx_ = nullptr;
      return UnavailableError("redis tier: " + std::string(what) + " refused by " + name() + ": " + why);
    }
    return Status::Ok();
  };
  if (!o_.password.empty()) {
    PAGEKV_RETURN_IF_ERROR(check(static_cast<redisReply*>(redisCommand(ctx_, "AUTH %b", o_.password.data(), o_.password.size())), "AUTH"));
  }
  if (ep_.db != 0) {
    PAGEKV_RETURN_IF_ERROR(check(static_cast<redisReply*>(redisCommand(ctx_, "SELECT %d", ep_.db)), "SELECT"));
  }
  healthy_ = true;
  backoff_ms_ = o_.backoff_initial_ms;
  return Status::Ok();
}

Status RedisConnection::Fail(const char* what) {
  std::string why = ctx_ != nullptr && ctx_->err != 0 ? ctx_->errstr : "no connection";
  if (ctx_ != nullptr) redisFree(ctx_);
  ctx_ = nullptr;
  healthy_ = false;
  ++errors_;
  const int delay = backoff_ms_;
  retry_at_ = Clock::now() + std::chrono::milliseconds(delay);
  backoff_ms_ = std::min(backoff_ms_ * 2, o_.backoff_max_ms);
  return UnavailableError("redis tier: " + std::string(what) + " on " + name() + " failed (" + why + "); retrying after " +
                          std::to_string(delay) + " ms");
}

void RedisConnection::Pipeline(std::span<const std::vector<std::string>* const> commands, std::vector<Reply>& replies,
                               Status& status) {
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  for (const std::vector<std::string>* c : commands) {
    argv.clear();
    lens.clear();
    for (const std::string& a : *c) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    if (redisAppendCommandArgv(ctx_, static_cast<int>(argv.size()), argv.data(), lens.data()) != REDIS_OK) {
      status = Fail((*c)[0].c_str());
      return;
    }
  }
  for (const std::vector<std::string>* c : commands) {
    void* raw = nullptr;
    if (redisGetReply(ctx_, &raw) != REDIS_OK) {
      status = Fail((*c)[0].c_str());
      return;
    }
    replies.emplace_back(static_cast<redisReply*>(raw));
  }
}

std::unique_ptr<RedisTransport> MakeSingleNodeTransport(const RedisStoreOptions& o, RedisEndpoint e) {
  return std::make_unique<SingleNode>(o, std::move(e));
}

}  // namespace pagekv::tiers
