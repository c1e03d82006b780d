// The Redis tier over a Redis Cluster (redis_transport.h). No client in
// Debian 12 speaks Cluster (hiredis 0.14 does not), so the routing is ours,
// kept to what a cache needs:
//
// - Each key's hash slot (CRC16 of the key, or of its {hash tag}, mod
//   16384) picks the primary that owns it, from a slot map loaded with
//   CLUSTER SLOTS from any node that answers (the seeds first).
// - A call's commands are grouped per primary and pipelined: one round trip
//   per node, all nodes one after the other.
// - "MOVED slot host:port" (the slot has a new owner, after a resharding or
//   a failover) updates that slot at once, retries the command there, and
//   reloads the whole map before the next call. "ASK slot host:port" (the
//   key is being migrated) sends ASKING and the command to that node, once;
//   the map is unchanged.
// - A node that cannot be reached is backed off (RedisConnection) and its
//   commands fail: for a cache, misses. The map is then reloaded (at most
//   every reload_ms): once the cluster has promoted a replica, the slots
//   route to it and hits resume.
//
// Hash tags: keys are "<namespace>:<block key hex>", so blocks spread over
// every primary by their own key. Putting a chain's blocks on one node would
// need a tag every lookup could compute, but a lookup asks for keys alone
// (the chain's first key is not passed down), and one node per chain would
// concentrate a long shared prefix's traffic; a namespace with a {tag} puts
// every block on one node, should that be wanted.
#include <algorithm>
#include <array>
#include <cstdlib>
#include <map>

#include "tiers/redis_transport.h"

namespace pagekv::tiers {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kSlots = 16384;
constexpr int kReloadMs = 100;  // the slot map is reloaded at most this often while something fails

uint16_t Crc16(std::string_view s) {
  uint16_t crc = 0;
  for (char ch : s) {
    crc ^= static_cast<uint16_t>(static_cast<uint8_t>(ch)) << 8;
    for (int i = 0; i < 8; ++i) crc = (crc & 0x8000) != 0 ? static_cast<uint16_t>((crc << 1) ^ 0x1021) : static_cast<uint16_t>(crc << 1);
  }
  return crc;
}

class Cluster final : public RedisTransport {
 public:
  Cluster(const RedisStoreOptions& o, std::vector<RedisEndpoint> seeds) : o_(o) {
    slots_.fill(-1);
    for (RedisEndpoint& e : seeds) NodeFor(e);
  }

  void Run(std::span<RedisOp> ops) override {
    if (reload_) Reload();
    std::vector<int> ask(ops.size(), -1);    // an ASK target, followed once
    std::vector<bool> asked(ops.size(), false);
    std::vector<size_t> pending(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) pending[i] = i;
    bool failed = false;
    // Round 0 sends everything; rounds 1-2 follow redirections.
    for (int round = 0; round < 3 && !pending.empty(); ++round) {
      std::map<int, std::vector<size_t>> by_node;
      for (size_t i : pending) {
        const int node = ask[i] >= 0 ? ask[i] : slots_[KeySlot(ops[i].argv[1])];
        if (node < 0) {
          ops[i].status = UnavailableError("redis cluster: no node serves the slot of this key (the cluster is down or resharding)");
          failed = true;
          continue;
        }
        by_node[node].push_back(i);
      }
      std::vector<size_t> next;
      for (auto& [node, idx] : by_node) {
        RedisConnection& c = *nodes_[static_cast<size_t>(node)];
        std::vector<const std::vector<std::string>*> commands;
        for (size_t i : idx) {
          if (ask[i] >= 0) commands.push_back(&kAsking);
          commands.push_back(&ops[i].argv);
        }
        std::vector<Reply> replies;
        Status status = c.Ensure();
        if (status.ok()) c.Pipeline(commands, replies, status);
        size_t at = 0;
        for (size_t i : idx) {
          const bool with_ask = ask[i] >= 0;
          ask[i] = -1;
          if (with_ask) ++at;  // ASKING's +OK
          if (at >= replies.size()) {
            ops[i].status = status;
            failed = true;
            continue;
          }
          Reply& r = replies[at++];
          if (r->type == REDIS_REPLY_ERROR) {
            if (std::optional<Redirect> to = ParseRedirect({r->str, r->len})) {
              if (to->to.host.empty()) to->to.host = c.endpoint().host;  // ":port": the node that answered
              const int target = NodeFor(to->to);
              if (!to->ask) {
                slots_[static_cast<size_t>(to->slot)] = target;  // now, for this call's other keys too
                reload_ = true;
                ++moved_;
                next.push_back(i);
                continue;
              }
              ++asks_;
              if (!asked[i]) {
                asked[i] = true;
                ask[i] = target;
                next.push_back(i);
                continue;
              }
            }
          }
          ops[i].reply = std::move(r);
        }
      }
      pending = std::move(next);
    }
    for (size_t i : pending) {
      ops[i].status = UnavailableError("redis cluster: redirected more than twice for one key");
      failed = true;
    }
    if (failed) reload_ = true;
    healthy_ = !failed;
  }

  bool healthy() const override { return healthy_; }
  int64_t errors() const override {
    int64_t n = 0;
    for (const auto& c : nodes_) n += c->errors();
    return n;
  }
  void AddStats(TierStats& s) const override {
    s.moved += moved_;
    s.asked += asks_;
    s.slot_map_loads += reloads_;
    s.nodes = static_cast<int64_t>(nodes_.size());
  }

 private:
  // The node at e, added the first time it is met.
  int NodeFor(const RedisEndpoint& e) {
    for (size_t i = 0; i < nodes_.size(); ++i) {
      if (nodes_[i]->endpoint().host == e.host && nodes_[i]->endpoint().port == e.port) return static_cast<int>(i);
    }
    nodes_.push_back(std::make_unique<RedisConnection>(o_, e));
    return static_cast<int>(nodes_.size() - 1);
  }

  // CLUSTER SLOTS from the first node that answers (healthy ones first);
  // the old map stays when none does.
  void Reload() {
    if (Clock::now() < next_reload_) return;
    next_reload_ = Clock::now() + std::chrono::milliseconds(kReloadMs);
    std::vector<size_t> order(nodes_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_partition(order.begin(), order.end(), [&](size_t i) { return nodes_[i]->healthy(); });
    static const std::vector<std::string> kSlotsCommand = {"CLUSTER", "SLOTS"};
    for (size_t n : order) {
      RedisConnection& c = *nodes_[n];
      if (!c.Ensure().ok()) continue;
      std::vector<Reply> replies;
      Status status = Status::Ok();
      const std::vector<std::string>* command = &kSlotsCommand;
      c.Pipeline({&command, 1}, replies, status);
      if (!status.ok() || replies.empty() || replies[0]->type != REDIS_REPLY_ARRAY) continue;
      std::array<int16_t, kSlots> map;
      map.fill(-1);
      const redisReply* r = replies[0].get();
      for (size_t k = 0; k < r->elements; ++k) {
        const redisReply* range = r->element[k];
        if (range->type != REDIS_REPLY_ARRAY || range->elements < 3) continue;
        const redisReply* primary = range->element[2];
        if (range->element[0]->type != REDIS_REPLY_INTEGER || range->element[1]->type != REDIS_REPLY_INTEGER ||
            primary->type != REDIS_REPLY_ARRAY || primary->elements < 2 ||
            primary->element[0]->type != REDIS_REPLY_STRING || primary->element[1]->type != REDIS_REPLY_INTEGER) {
          continue;
        }
        RedisEndpoint e;
        e.host.assign(primary->element[0]->str, primary->element[0]->len);
        if (e.host.empty() || e.host == "?") e.host = c.endpoint().host;  // "": the node we asked
        e.port = static_cast<int>(primary->element[1]->integer);
        const int node = NodeFor(e);
        const auto from = std::clamp<long long>(range->element[0]->integer, 0, kSlots - 1);
        const auto to = std::clamp<long long>(range->element[1]->integer, 0, kSlots - 1);
        for (long long s = from; s <= to; ++s) map[static_cast<size_t>(s)] = static_cast<int16_t>(node);
      }
      slots_ = map;
      reload_ = false;
      ++reloads_;
      return;
    }
  }

  const std::vector<std::string> kAsking = {"ASKING"};
  const RedisStoreOptions& o_;
  std::vector<std::unique_ptr<RedisConnection>> nodes_;
  std::array<int16_t, kSlots> slots_;
  bool reload_ = true;
  Clock::time_point next_reload_{};
  bool healthy_ = true;
  int64_t moved_ = 0, asks_ = 0, reloads_ = 0;
};

}  // namespace

uint16_t KeySlot(std::string_view key) {
  if (const size_t open = key.find('{'); open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  return static_cast<uint16_t>(Crc16(key) % kSlots);
}

std::optional<Redirect> ParseRedirect(std::string_view error) {
  Redirect r;
  if (error.rfind("MOVED ", 0) == 0) {
    error.remove_prefix(6);
  } else if (error.rfind("ASK ", 0) == 0) {
    r.ask = true;
    error.remove_prefix(4);
  } else {
    return std::nullopt;
  }
  const size_t space = error.find(' ');
  if (space == std::string_view::npos) return std::nullopt;
  const std::string slot(error.substr(0, space));
  const std::string where(error.substr(space + 1));
  char* end = nullptr;
  const long s = std::strtol(slot.c_str(), &end, 10);
  if (slot.empty() || *end != '\0' || s < 0 || s >= kSlots) return std::nullopt;
  r.slot = static_cast<int>(s);
  const size_t colon = where.rfind(':');
  if (colon == std::string::npos) return std::nullopt;
  const std::string port = where.substr(colon + 1);
  const long p = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || p < 1 || p > 65535) return std::nullopt;
  r.to.host = where.substr(0, colon);  // may be empty: the node that answered
  r.to.port = static_cast<int>(p);
  return r;
}

std::unique_ptr<RedisTransport> MakeClusterTransport(const RedisStoreOptions& o, std::vector<RedisEndpoint> seeds) {
  return std::make_unique<Cluster>(o, std::move(seeds));
}

}  // namespace pagekv::tiers
