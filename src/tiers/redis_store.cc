// The Redis tier (include/pagekv/tiers.h): blocks as binary string values
// under "<namespace>:<key hex>", on one server or spread over a Redis
// Cluster (tiers/redis_transport.h: per-key commands, pipelined per node).
// A connection or timeout failure drops that node's connection and marks it
// unhealthy: its commands fail fast (kUnavailable) until a backoff delay
// passes (doubling from backoff_initial_ms to backoff_max_ms), then the next
// call reconnects. A call whose every command failed is an error (the tier
// is down); commands that failed among answered ones are misses (a cluster
// node down).
#include <chrono>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "pagekv/tiers.h"
#include "tiers/block_payload.h"
#include "tiers/key_hash.h"
#include "tiers/redis_transport.h"

namespace pagekv {
namespace {

using tiers::RedisOp;
using tiers::Reply;

class RedisStore final : public BlockStore {
 public:
  RedisStore(const RedisStoreOptions& o, std::unique_ptr<tiers::RedisTransport> (*make)(const RedisStore&))
      : o_(o), net_(make(*this)) {}
  const RedisStoreOptions& options() const { return o_; }

  Tier tier() const override { return Tier::kRedis; }

  Status Put(const BlockMeta& meta, std::span<const std::byte> kv) override {
    return PutMany({&meta, 1}, std::span<const std::span<const std::byte>>(&kv, 1));
  }

  Result<bool> Get(const BlockMeta& meta, std::span<std::byte> kv) override {
    PAGEKV_ASSIGN_OR_RETURN(std::vector<bool> got, GetMany({&meta, 1}, std::span<const std::span<std::byte>>(&kv, 1)));
    return static_cast<bool>(got[0]);
  }

  Result<bool> Contains(const BlockKey& key) override {
    PAGEKV_ASSIGN_OR_RETURN(std::vector<bool> v, ContainsMany({&key, 1}));
    return static_cast<bool>(v[0]);
  }

  // EXISTS per key, pipelined. A key whose node is down is not held.
  Result<std::vector<bool>> ContainsMany(std::span<const BlockKey> keys) override {
    std::vector<RedisOp> ops(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) ops[i].argv = {"EXISTS", Key(keys[i])};
    std::lock_guard lock(mu_);
    PAGEKV_RETURN_IF_ERROR(Run(ops));
    std::vector<bool> out(keys.size(), false);
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!ops[i].status.ok()) continue;
      if (ops[i].reply->type != REDIS_REPLY_INTEGER) {
        Refused(ops[i].reply, "EXISTS").IgnoreError();  // counted; not held as far as we know
        continue;
      }
      out[i] = ops[i].reply->integer > 0;
      if (!out[i]) Gone(keys[i]);
    }
    return out;
  }

  // SET per block, pipelined; the first refusal is returned after every
  // reply is read.
  Status PutMany(std::span<const BlockMeta> metas, std::span<const std::span<const std::byte>> kvs) override {
    std::vector<RedisOp> ops(metas.size());
    std::vector<int64_t> sizes(metas.size());
    std::vector<std::byte> payload;
    for (size_t i = 0; i < metas.size(); ++i) {
      tiers::EncodePayload(metas[i], kvs[i], seal_, payload);
      sizes[i] = static_cast<int64_t>(payload.size());
      ops[i].argv = {"SET", Key(metas[i].key), std::string(reinterpret_cast<const char*>(payload.data()), payload.size())};
      if (o_.ttl_seconds > 0) {
        ops[i].argv.push_back("EX");
        ops[i].argv.push_back(std::to_string(o_.ttl_seconds));
      }
    }
    std::lock_guard lock(mu_);
    PAGEKV_RETURN_IF_ERROR(Run(ops));
    Status first = Status::Ok();
    for (size_t i = 0; i < metas.size(); ++i) {
      Status st = ops[i].status;
      if (st.ok() && ops[i].reply->type == REDIS_REPLY_ERROR) st = Refused(ops[i].reply, "SET");
      if (!st.ok()) {
        if (first.ok()) first = st;
        continue;
      }
      ++stats_.puts;
      Held(metas[i], sizes[i]);
    }
    return first;
  }

  // GET per block, pipelined. A block whose node is down is a miss.
  Result<std::vector<bool>> GetMany(std::span<const BlockMeta> metas, std::span<const std::span<std::byte>> kvs) override {
    std::vector<RedisOp> ops(metas.size());
    for (size_t i = 0; i < metas.size(); ++i) ops[i].argv = {"GET", Key(metas[i].key)};
    std::lock_guard lock(mu_);
    PAGEKV_RETURN_IF_ERROR(Run(ops));
    std::vector<bool> out(metas.size(), false);
    std::vector<size_t> bad;
    for (size_t i = 0; i < metas.size(); ++i) {
      ++stats_.gets;
      const Reply& r = ops[i].reply;
      if (!ops[i].status.ok()) {
        ++stats_.misses;
        continue;
      }
      if (r->type == REDIS_REPLY_ERROR) {
        // The server refused (a cluster without a node for the slot:
        // CLUSTERDOWN, TRYAGAIN): a miss, not a bad payload.
        ++stats_.misses;
        Refused(r, "GET").IgnoreError();
        continue;
      }
      if (r->type == REDIS_REPLY_NIL) {
        ++stats_.misses;
        Gone(metas[i].key);  // evicted or expired by the server, or deleted by another process
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
        // A block this key cannot authenticate stays: the namespace is
        // shared, and a process given the wrong key must not wipe the
        // others' blocks.
        if (tiers::IsNotAuthentic(d)) {
          ++stats_.unauthenticated;
        } else {
          bad.push_back(i);
        }
      }
    }
    if (!bad.empty()) {
      // Payloads that failed their checks: deleted, best effort (a failed
      // DEL shows on the next call, and the key stays counted until gone).
      std::vector<RedisOp> del(bad.size());
      for (size_t j = 0; j < bad.size(); ++j) del[j].argv = {"DEL", Key(metas[bad[j]].key)};
      net_->Run(del);
      for (size_t j = 0; j < bad.size(); ++j) {
        if (del[j].status.ok() && del[j].reply->type == REDIS_REPLY_INTEGER) Dropped(metas[bad[j]].key, del[j].reply->integer > 0);
      }
    }
    return out;
  }

  Status Remove(const BlockKey& k) override {
    std::vector<RedisOp> ops(1);
    ops[0].argv = {"DEL", Key(k)};
    std::lock_guard lock(mu_);
    PAGEKV_RETURN_IF_ERROR(Run(ops));
    PAGEKV_RETURN_IF_ERROR(ops[0].status);
    if (ops[0].reply->type == REDIS_REPLY_ERROR) return Refused(ops[0].reply, "DEL");
    Dropped(k, ops[0].reply->type == REDIS_REPLY_INTEGER && ops[0].reply->integer > 0);
    return Status::Ok();
  }

  int64_t capacity_bytes() const override { return 0; }

  TierStats Stats() const override {
    std::lock_guard lock(mu_);
    TierStats s = stats_;
    s.name = "redis";
    s.healthy = net_->healthy();
    s.errors += net_->errors();
    s.blocks_now = static_cast<int64_t>(held_.size());
    s.bytes_now = held_bytes_;
    net_->AddStats(s);
    return s;
  }

 private:
  std::string Key(const BlockKey& k) const { return o_.key_namespace + ":" + k.Hex(); }

  // REQUIRES: mu_ held (for all below). Runs the ops; an error when none
  // was answered (the tier is down), else each op's own status stands.
  Status Run(std::span<RedisOp> ops) {
    if (ops.empty()) return Status::Ok();
    net_->Run(ops);
    for (const RedisOp& op : ops) {
      if (op.status.ok()) return Status::Ok();
    }
    return ops[0].status;
  }

  // A reply that is an error: the server said no.
  Status Refused(const Reply& r, const char* what) {
    ++stats_.errors;
    return UnavailableError("redis tier: " + std::string(what) + " refused: " +
                            (r && r->type == REDIS_REPLY_ERROR ? std::string(r->str, r->len) : "unexpected reply"));
  }

  // The keys this process put and has not seen leave, with their payload
  // sizes: what blocks_now / bytes_now count (a re-put is not a new block).
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

  const RedisStoreOptions o_;
  const tiers::PayloadSeal seal_{o_.payload_key};
  std::unique_ptr<tiers::RedisTransport> net_;
  mutable std::mutex mu_;
  TierStats stats_;
  std::unordered_map<BlockKey, int64_t, tiers::KeyHash> held_;
  int64_t held_bytes_ = 0;
};

}  // namespace

Result<std::unique_ptr<BlockStore>> CreateRedisStore(const RedisStoreOptions& o) {
  if (o.timeout_ms < 1) return InvalidArgumentError("redis tier: timeout_ms must be at least 1");
  if (o.key_namespace.empty()) return InvalidArgumentError("redis tier: the key namespace is empty");
  if (!o.cluster_nodes.empty()) {
    if (!o.url.empty()) {
      return InvalidArgumentError("redis tier: give a url (one server) or cluster nodes (a Redis Cluster), not both");
    }
    PAGEKV_RETURN_IF_ERROR(tiers::ParseClusterNodes(o.cluster_nodes).status());
    return std::unique_ptr<BlockStore>(new RedisStore(o, [](const RedisStore& s) {
      return tiers::MakeClusterTransport(s.options(), *tiers::ParseClusterNodes(s.options().cluster_nodes));
    }));
  }
  PAGEKV_RETURN_IF_ERROR(tiers::ParseRedisUrl(o.url).status());
  return std::unique_ptr<BlockStore>(new RedisStore(o, [](const RedisStore& s) {
    return tiers::MakeSingleNodeTransport(s.options(), *tiers::ParseRedisUrl(s.options().url));
  }));
}

}  // namespace pagekv
