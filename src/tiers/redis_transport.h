// How the Redis tier (redis_store.cc) reaches its server: one node
// (redis://host:port/db), or a Redis Cluster (redis_cluster.cc) whose keys
// are spread over 16,384 hash slots owned by primaries that may move, fail
// and be replaced. The store builds each call as per-key commands; the
// transport pipelines them (per node, for a cluster) and answers each with
// the server's reply, or a status when no node answered it.
//
// Private to the tiers module. Thread safety: none; the store serialises
// calls.
#pragma once

#include <hiredis/hiredis.h>

#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pagekv/tiers.h"

namespace pagekv::tiers {

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

struct RedisEndpoint {
  std::string host = "127.0.0.1";
  int port = 6379;
  int db = 0;
};

// redis://host[:port][/db]; a url with credentials is refused.
Result<RedisEndpoint> ParseRedisUrl(const std::string& url);
// host:port[,host:port...] (a Redis Cluster's seed nodes); the port is required.
Result<std::vector<RedisEndpoint>> ParseClusterNodes(const std::string& list);

// One command on one key (argv[1]), pipelined with the others of a call.
struct RedisOp {
  std::vector<std::string> argv;
  Reply reply;                    // the answer (an error reply included)
  Status status = Status::Ok();   // not ok: no node answered (down, backing off, redirected too often)
};

class RedisTransport {
 public:
  virtual ~RedisTransport() = default;
  // Sends every op and fills its reply or status.
  virtual void Run(std::span<RedisOp> ops) = 0;
  // Whether the last calls reached every node they needed.
  virtual bool healthy() const = 0;
  // Transport failures so far (connections lost or refused, timeouts).
  virtual int64_t errors() const = 0;
  // A cluster's routing counters (TierStats::moved and the rest).
  virtual void AddStats(TierStats& /*s*/) const {}
};

// One connection to one server, with the tier's timeouts and backoff: a
// failure drops it and fails fast until the backoff delay passes (doubling
// from options.backoff_initial_ms to backoff_max_ms), then reconnects.
class RedisConnection {
 public:
  RedisConnection(const RedisStoreOptions& o, RedisEndpoint e);
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  // Connected (AUTH and SELECT done), or why not.
  Status Ensure();
  // A transport failure during `what`: drop the connection, back off.
  Status Fail(const char* what);
  redisContext* ctx() { return ctx_; }
  const RedisEndpoint& endpoint() const { return ep_; }
  std::string name() const { return ep_.host + ":" + std::to_string(ep_.port); }
  bool healthy() const { return healthy_; }
  int64_t errors() const { return errors_; }

  // Pipelines commands (argv each) and reads as many replies; a transport
  // failure fails every one not answered yet.
  void Pipeline(std::span<const std::vector<std::string>* const> commands, std::vector<Reply>& replies, Status& status);

 private:
  const RedisStoreOptions& o_;
  RedisEndpoint ep_;
  redisContext* ctx_ = nullptr;
  bool healthy_ = true;
  int backoff_ms_ = 100;
  std::chrono::steady_clock::time_point retry_at_{};
  int64_t errors_ = 0;
};

std::unique_ptr<RedisTransport> MakeSingleNodeTransport(const RedisStoreOptions& o, RedisEndpoint e);
std::unique_ptr<RedisTransport> MakeClusterTransport(const RedisStoreOptions& o, std::vector<RedisEndpoint> seeds);

// The cluster's hash slot of a key: CRC16 (XMODEM) of the key, or of its
// hash tag (the bytes between the first '{' and the next '}', when not
// empty), mod 16384.
uint16_t KeySlot(std::string_view key);

// A cluster's redirection error reply: "MOVED <slot> <host>:<port>" (the
// slot has a new owner) or "ASK <slot> <host>:<port>" (this key is being
// migrated: ask there once, after ASKING).
struct Redirect {
  bool ask = false;
  int slot = 0;
  RedisEndpoint to;
};
std::optional<Redirect> ParseRedirect(std::string_view error);

}  // namespace pagekv::tiers
