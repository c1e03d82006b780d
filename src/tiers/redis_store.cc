// The Redis tier (include/pagekv/tiers.h): blocks as binary string values
// under "<namespace>:<key hex>", through one hiredis connection with
// timeouts. A connection or timeout failure drops the connection and marks
// the tier unhealthy: calls fail fast (kUnavailable) until a backoff delay
// passes (doubling from backoff_initial_ms to backoff_max_ms), then the next
// call reconnects.
#include <hiredis/hiredis.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "pagekv/tiers.h"
#include "tiers/block_payload.h"
#include "tiers/key_hash.h"

namespace pagekv {
namespace {

using Clock = std::chrono::steady_clock;

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

struct Endpoint {
  std::string host = "127.0.0.1";
  int port = 6379;
  int db = 0;
  std::string password;
};

Result<Endpoint> ParseUrl(const std::string& url) {
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
  Endpoint e;
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
    const std::string port = rest.substr(colon + 1);
    char* end = nullptr;
    const long v = std::strtol(port.c_str(), &end, 10);
    if (port.empty() || *end != '\0' || v < 1 || v > 65535) {
      return InvalidArgumentError("redis url: port '" + port + "' is not in 1..65535");
    }
    e.port = static_cast<int>(v);
    rest = rest.substr(0, colon);
  }
  if (!rest.empty()) e.host = rest;
  return e;
}

timeval Tv(int ms) { return timeval{ms / 1000, (ms % 1000) * 1000}; }

class RedisStore final : public BlockStore {
 public:
  RedisStore(const RedisStoreOptions& o, Endpoint e) : o_(o), ep_(std::move(e)) {
    if (!o_.password.empty()) ep_.password = o_.password;
    backoff_ms_ = o_.backoff_initial_ms;
  }
  ~RedisStore() override {
    if (ctx_ != nullptr) redisFree(ctx_);
  }

  Tier tier() const override { return Tier::kRedis; }

  Status Put(const BlockMeta& meta, std::span<const std::byte> kv) override {
    std::vector<std::byte> payload;
    tiers::EncodePayload(meta, kv, seal_, payload);
    const std::string key = Key(meta.key);
    std::lock_guard lock(mu_);
    PAGEKV_RETURN_IF_ERROR(Connect());
    Reply r = o_.ttl_seconds > 0
                  ? Command("SET %b %b EX %lld", key.data(), key.size(), payload.data(), payload.size(),
                            static_cast<long long>(o_.ttl_seconds))
                  : Command("SET %b %b", key.data(), key.size(), payload.data(), payload.size());
    PAGEKV_RETURN_IF_ERROR(Check(r, "SET"));
    ++stats_.puts;
    Held(meta, static_cast<int64_t>(payload.size()));
    return Status::Ok();
  }

  Result<bool> Get(const BlockMeta& meta, std::span<std::byte> kv) override {
    const std::string key = Key(meta.key);
    std::lock_guard lock(mu_);
    ++stats_.gets;
    PAGEKV_RETURN_IF_ERROR(Connect());
    Reply r = Command("GET %b", key.data(), key.size());
    PAGEKV_RETURN_IF_ERROR(Check(r, "GET"));
    if (r->type == REDIS_REPLY_NIL) {
      ++stats_.misses;
      Gone(meta.key);  // evicted or expired by the server, or deleted by another process
      return false;
    }
    const Status d = r->type == REDIS_REPLY_STRING
                         ? tiers::DecodePayload({reinterpret_cast<const std::byte*>(r->str), r->len}, meta, kv, seal_)
                         : DataLossError("redis tier: GET did not return a string");
    if (!d.ok()) {
      ++stats_.corrupt;
      ++stats_.misses;
      // A block this key cannot authenticate stays: the namespace is shared,
      // and a process given the wrong key must not wipe the others' blocks.
      if (tiers::IsNotAuthentic(d)) {
        ++stats_.unauthenticated;
      } else {
        Delete(meta.key, key);
      }
      return false;
    }
    ++stats_.hits;
    return true;
  }

  Result<bool> Contains(const BlockKey& key) override {
    PAGEKV_ASSIGN_OR_RETURN(std::vector<bool> v, ContainsMany({&key, 1}));
    return static_cast<bool>(v[0]);
  }

  // One pipelined round trip: EXISTS per key.
  Result<std::vector<bool>> ContainsMany(std::span<const BlockKey> keys) override {
    std::lock_guard lock(mu_);
    PAGEKV_RETURN_IF_ERROR(Connect());
    for (const BlockKey& k : keys) {
      const std::string key = Key(k);
      if (redisAppendCommand(ctx_, "EXISTS %b", key.data(), key.size()) != REDIS_OK) return Fail("EXISTS");
    }
    std::vector<bool> out;
    for (size_t i = 0; i < keys.size(); ++i) {
      void* raw = nullptr;
      if (redisGetReply(ctx_, &raw) != REDIS_OK) return Fail("EXISTS");
      Reply r(static_cast<redisReply*>(raw));
      if (r->type != REDIS_REPLY_INTEGER) return Failed(r, "EXISTS");
      out.push_back(r->integer > 0);
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!out[i]) Gone(keys[i]);
    }
    return out;
  }

  // One pipelined round trip: SET per block.
  Status PutMany(std::span<const BlockMeta> metas, std::span<const std::span<const std::byte>> kvs) override {
    std::vector<std::vector<std::byte>> payloads(metas.size());
    std::vector<std::string> keys;
    for (size_t i = 0; i < metas.size(); ++i) {
      tiers::EncodePayload(metas[i], kvs[i], seal_, payloads[i]);
      keys.push_back(Key(metas[i].key));
    }
    std::lock_guard lock(mu_);
    PAGEKV_RETURN_IF_ERROR(Connect());
    for (size_t i = 0; i < metas.size(); ++i) {
      const int rc = o_.ttl_seconds > 0
                         ? redisAppendCommand(ctx_, "SET %b %b EX %lld", keys[i].data(), keys[i].size(), payloads[i].data(),
                                              payloads[i].size(), static_cast<long long>(o_.ttl_seconds))
                         : redisAppendCommand(ctx_, "SET %b %b", keys[i].data(), keys[i].size(), payloads[i].data(),
                                              payloads[i].size());
      if (rc != REDIS_OK) return Fail("SET");
    }
    Status first = Status::Ok();
    for (size_t i = 0; i < metas.size(); ++i) {
      void* raw = nullptr;
      if (redisGetReply(ctx_, &raw) != REDIS_OK) return Fail("SET");
      Reply r(static_cast<redisReply*>(raw));
      if (r->type == REDIS_REPLY_ERROR) {
        if (first.ok()) first = Failed(r, "SET");  // read every reply, keep the first refusal
        continue;
      }
      ++stats_.puts;
      Held(metas[i], static_cast<int64_t>(payloads[i].size()));
    }
    return first;
  }

  // One pipelined round trip: GET per block.
  Result<std::vector<bool>> GetMany(std::span<const BlockMeta> metas, std::span<const std::span<std::byte>> kvs) override {
    std::vector<std::string> keys;
    for (const BlockMeta& m : metas) keys.push_back(Key(m.key));
    std::lock_guard lock(mu_);
    PAGEKV_RETURN_IF_ERROR(Connect());
    for (const std::string& key : keys) {
      if (redisAppendCommand(ctx_, "GET %b", key.data(), key.size()) != REDIS_OK) return Fail("GET");
    }
    std::vector<bool> out(metas.size(), false);
    std::vector<size_t> bad;
    for (size_t i = 0; i < metas.size(); ++i) {
      void* raw = nullptr;
      if (redisGetReply(ctx_, &raw) != REDIS_OK) return Fail("GET");
      Reply r(static_cast<redisReply*>(raw));
      ++stats_.gets;
      if (r->type == REDIS_REPLY_NIL) {
        ++stats_.misses;
        Gone(metas[i].key);
      } else if (const Status d =
                     r->type == REDIS_REPLY_STRING
                         ? tiers::DecodePayload({reinterpret_cast<const std::byte*>(r->str), r->len}, metas[i], kvs[i], seal_)
                         : DataLossError("redis tier: GET did not return a string");
                 d.ok()) {
        ++stats_.hits;
        out[i] = true;
      } else {
        ++stats_.corrupt;
        ++stats_.misses;
        if (tiers::IsNotAuthentic(d)) {
          ++stats_.unauthenticated;  // left for the processes that hold its key (as Get)
        } else {
          bad.push_back(i);
        }
      }
    }
    for (size_t i : bad) Delete(metas[i].key, keys[i]);
    return out;
  }

  Status Remove(const BlockKey& k) override {
    const std::string key = Key(k);
    std::lock_guard lock(mu_);
    PAGEKV_RETURN_IF_ERROR(Connect());
    Reply r = Command("DEL %b", key.data(), key.size());
    PAGEKV_RETURN_IF_ERROR(Check(r, "DEL"));
    Dropped(k, r->type == REDIS_REPLY_INTEGER && r->integer > 0);
    return Status::Ok();
  }

  int64_t capacity_bytes() const override { return 0; }

  TierStats Stats() const override {
    std::lock_guard lock(mu_);
    TierStats s = stats_;
    s.name = "redis";
    s.healthy = healthy_;
    s.blocks_now = static_cast<int64_t>(held_.size());
    s.bytes_now = held_bytes_;
    return s;
  }

 private:
  std::string Key(const BlockKey& k) const { return o_.key_namespace + ":" + k.Hex(); }

  // The keys this process put and has not seen leave, with their payload
  // sizes: what blocks_now / bytes_now count (a re-put is not a new block).
  // REQUIRES: mu_ held (for all four below).
  void Held(const BlockMeta& meta, int64_t bytes) {
    auto [it, fresh] = held_.try_emplace(meta.key, bytes);
    held_bytes_ += bytes - (fresh ? 0 : it->second);
    it->second = bytes;
    if (fresh && o_.on_change) o_.on_change(TierChange{TierChange::Kind::kStored, Tier::kRedis, meta});
  }
  // `key` left the server: we deleted it (existed), or found it missing.
  void Dropped(const BlockKey& key, bool existed) {
    auto it = held_.find(key);
    const bool ours = it != held_.end();
    if (ours) {
      held_bytes_ -= it->second;
      held_.erase(it);
    }
    if ((ours || existed) && o_.on_change) {
      TierChange c{TierChange::Kind::kRemoved, Tier::kRedis, {}};
      c.meta.key = key;
      o_.on_change(c);
    }
  }
  void Gone(const BlockKey& key) {
    if (held_.count(key) > 0) Dropped(key, false);
  }
  // A payload that failed its checks: deleted, best effort (a failed DEL
  // shows on the next call, and the key stays counted until it is gone).
  void Delete(const BlockKey& k, const std::string& key) {
    Reply d = Command("DEL %b", key.data(), key.size());
    if (d && d->type == REDIS_REPLY_INTEGER) Dropped(k, d->integer > 0);
  }

  template <typename... Args>
  Reply Command(const char* fmt, Args... args) {
    return Reply(static_cast<redisReply*>(redisCommand(ctx_, fmt, args...)));
  }

  // REQUIRES: mu_ held. Connects when needed; fails fast while backing off.
  Status Connect() {
    if (ctx_ != nullptr) return Status::Ok();
    if (Clock::now() < retry_at_) {
      ++stats_.errors;
      return UnavailableError("redis tier: " + ep_.host + ":" + std::to_string(ep_.port) +
                              " is unhealthy; retrying after a backoff");
    }
    ctx_ = redisConnectWithTimeout(ep_.host.c_str(), ep_.port, Tv(o_.timeout_ms));
    if (ctx_ == nullptr || ctx_->err != 0) return Fail("connect");
    redisSetTimeout(ctx_, Tv(o_.timeout_ms));
    if (!ep_.password.empty()) {
      Reply r = Command("AUTH %b", ep_.password.data(), ep_.password.size());
      PAGEKV_RETURN_IF_ERROR(Check(r, "AUTH"));
    }
    if (ep_.db != 0) {
      Reply r = Command("SELECT %d", ep_.db);
      PAGEKV_RETURN_IF_ERROR(Check(r, "SELECT"));
    }
    healthy_ = true;
    backoff_ms_ = o_.backoff_initial_ms;
    return Status::Ok();
  }

  // REQUIRES: mu_ held. A transport failure: drop the connection, back off.
  Status Fail(const char* what) {
    std::string why = ctx_ != nullptr && ctx_->err != 0 ? ctx_->errstr : "no connection";
    if (ctx_ != nullptr) redisFree(ctx_);
    ctx_ = nullptr;
    healthy_ = false;
    ++stats_.errors;
    const int delay = backoff_ms_;
    retry_at_ = Clock::now() + std::chrono::milliseconds(delay);
    backoff_ms_ = std::min(backoff_ms_ * 2, o_.backoff_max_ms);
    return UnavailableError("redis tier: " + std::string(what) + " on " + ep_.host + ":" + std::to_string(ep_.port) +
                            " failed (" + why + "); retrying after " + std::to_string(delay) + " ms");
  }

  // REQUIRES: mu_ held. A reply that is an error: the server said no.
  Status Failed(const Reply& r, const char* what) {
    ++stats_.errors;
    return UnavailableError("redis tier: " + std::string(what) + " refused: " +
                            (r && r->type == REDIS_REPLY_ERROR ? std::string(r->str, r->len) : "unexpected reply"));
  }

  Status Check(const Reply& r, const char* what) {
    if (!r) return Fail(what);
    if (r->type == REDIS_REPLY_ERROR) return Failed(r, what);
    return Status::Ok();
  }

  const RedisStoreOptions o_;
  const tiers::PayloadSeal seal_{o_.payload_key};
  Endpoint ep_;
  mutable std::mutex mu_;
  redisContext* ctx_ = nullptr;
  bool healthy_ = true;
  int backoff_ms_ = 100;
  Clock::time_point retry_at_{};
  TierStats stats_;
  std::unordered_map<BlockKey, int64_t, tiers::KeyHash> held_;
  int64_t held_bytes_ = 0;
};

}  // namespace

Result<std::unique_ptr<BlockStore>> CreateRedisStore(const RedisStoreOptions& o) {
  PAGEKV_ASSIGN_OR_RETURN(Endpoint e, ParseUrl(o.url));
  if (o.timeout_ms < 1) return InvalidArgumentError("redis tier: timeout_ms must be at least 1");
  if (o.key_namespace.empty()) return InvalidArgumentError("redis tier: the key namespace is empty");
  return std::unique_ptr<BlockStore>(new RedisStore(o, std::move(e)));
}

}  // namespace pagekv
