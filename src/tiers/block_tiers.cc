// BlockTiers (include/pagekv/tiers.h): the configured stores in order, a
// bounded job queue with worker threads (puts down the tiers, prefetches
// up), and a staging area of prefetched blocks waiting for their load.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "pagekv/tiers.h"
#include "tiers/block_payload.h"
#include "tiers/key_hash.h"

#include <xxhash.h>

namespace pagekv {

Result<std::vector<bool>> BlockStore::ContainsMany(std::span<const BlockKey> keys) {
  std::vector<bool> out;
  out.reserve(keys.size());
  for (const BlockKey& k : keys) {
    PAGEKV_ASSIGN_OR_RETURN(bool has, Contains(k));
    out.push_back(has);
  }
  return out;
}

Status BlockStore::PutMany(std::span<const BlockMeta> metas, std::span<const std::span<const std::byte>> kvs) {
  for (size_t i = 0; i < metas.size(); ++i) PAGEKV_RETURN_IF_ERROR(Put(metas[i], kvs[i]));
  return Status::Ok();
}

Result<std::vector<bool>> BlockStore::GetMany(std::span<const BlockMeta> metas, std::span<const std::span<std::byte>> kvs) {
  std::vector<bool> out;
  for (size_t i = 0; i < metas.size(); ++i) {
    PAGEKV_ASSIGN_OR_RETURN(bool got, Get(metas[i], kvs[i]));
    out.push_back(got);
  }
  return out;
}

int64_t TierPayloadBytes(int32_t block_len, int64_t kv_bytes) {
  return static_cast<int64_t>(tiers::PayloadBytes(static_cast<size_t>(block_len), static_cast<size_t>(kv_bytes)));
}

Result<std::string> FileFingerprint(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return NotFoundError("fingerprint: cannot read " + path);
  XXH3_state_t* st = XXH3_createState();
  XXH3_128bits_reset(st);
  std::vector<char> buf(1 << 20);
  uint64_t size = 0;
  for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), f)) > 0;) {
    XXH3_128bits_update(st, buf.data(), n);
    size += n;
  }
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  XXH3_128bits_update(st, &size, sizeof size);
  const XXH128_hash_t h = XXH3_128bits_digest(st);
  XXH3_freeState(st);
  if (failed) return UnavailableError("fingerprint: read error in " + path);
  char hex[33];
  std::snprintf(hex, sizeof hex, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return std::string(hex);
}

bool TiersConfigured(const TierOptions& o) {
  return o.host_bytes > 0 || !o.disk_path.empty() || !o.redis_url.empty() || !o.redis_cluster.empty();
}

namespace {

struct Job {
  enum class Kind : uint8_t { kPut, kPrefetch, kLoad, kOffload } kind = Kind::kPut;
  BlockStore* target = nullptr;  // kPut
  BlockMeta meta;
  std::vector<std::byte> kv;     // kPut
  TierLoadJob load;              // kLoad (its meta is `meta`)
  TierOffloadJob offload;        // kOffload
};

// A prefetched block, kept as a whole payload (header, token ids, KV) so
// that its load is checked against the loading request's meta by the same
// DecodePayload every store's Get uses, not matched on its key alone.
struct Staged {
  std::vector<std::byte> payload;
  Tier from;
};

}  // namespace

struct BlockTiers::State {
  TierOptions o;
  int32_t block_len = 0;
  int64_t kv_bytes = 0;
  std::vector<std::unique_ptr<BlockStore>> stores;  // host, disk, redis: those configured
  BlockStore* by_tier[kNumTiers]{};

  std::mutex mu;  // the queue, staging and counters below
  std::condition_variable work_cv, idle_cv;
  std::deque<Job> queue;
  std::deque<Job> loads;  // background loads: served first, never dropped
  int64_t busy = 0;
  int64_t background_loads = 0, offloads = 0;
  bool stopping = false;
  std::unordered_map<BlockKey, Staged, tiers::KeyHash> staged;
  std::deque<BlockKey> staged_order;
  int64_t dropped = 0, prefetched = 0, load_failures = 0;
  int64_t load_hits[kNumTiers]{};
  int64_t staged_mismatches = 0;
  std::unordered_map<std::string, int64_t> fault_counts;
  std::vector<std::thread> workers;

  // The stores' changes, in order, while recording (RecordChanges).
  std::atomic<bool> record{false};
  std::mutex changes_mu;  // taken inside a store's lock, never around a store call
  std::deque<TierChange> changes;
  int64_t dropped_changes = 0;

  void Record(const TierChange& c) {
    if (!record.load(std::memory_order_relaxed)) return;
    std::lock_guard lock(changes_mu);
    if (static_cast<int64_t>(changes.size()) >= std::max<int64_t>(65536, 16 * o.queue_blocks)) {
      ++dropped_changes;
      return;
    }
    changes.push_back(c);
  }

  // Reports a fault; repeated ones every power of two, so a dead tier does
  // not flood the log.
  void Log(const std::string& what, const Status& s) {
    int64_t n;
    {
      std::lock_guard lock(mu);
      n = ++fault_counts[what];
    }
    if (o.log && (n & (n - 1)) == 0) {
      o.log("tiers: " + what + ": " + s.ToString() + " (" + std::to_string(n) + " so far; treated as a miss)");
    }
  }

  // The first store below `t` (nullptr: none).
  BlockStore* Below(Tier t) const {
    for (int i = static_cast<int>(t) + 1; i < kNumTiers; ++i) {
      if (by_tier[i] != nullptr) return by_tier[i];
    }
    return nullptr;
  }

  bool Enqueue(Job job) {
    std::lock_guard lock(mu);
    if (static_cast<int64_t>(queue.size()) >= o.queue_blocks) {
      ++dropped;
      return false;
    }
    queue.push_back(std::move(job));
    work_cv.notify_one();
    return true;
  }

  void EnqueuePut(BlockStore* target, const BlockMeta& meta, std::span<const std::byte> kv) {
    Job j;
    j.kind = Job::Kind::kPut;
    j.target = target;
    j.meta = meta;
    j.kv.assign(kv.begin(), kv.end());
    Enqueue(std::move(j));
  }

  void Stage(const BlockKey& key, std::vector<std::byte> payload, Tier from) {
    std::lock_guard lock(mu);
    if (staged.count(key) > 0) return;
    staged.emplace(key, Staged{std::move(payload), from});
    staged_order.push_back(key);
    ++prefetched;
    while (static_cast<int64_t>(staged_order.size()) > o.queue_blocks) {
      staged.erase(staged_order.front());
      staged_order.pop_front();
    }
  }

  // A batch of puts to one store (one round trip for redis).
  void RunPuts(std::vector<Job>& jobs) {
    std::vector<BlockMeta> metas;
    std::vector<std::span<const std::byte>> kvs;
    for (Job& j : jobs) {
      metas.push_back(std::move(j.meta));
      kvs.emplace_back(j.kv);
    }
    BlockStore* target = jobs.front().target;
    if (Status s = target->PutMany(metas, kvs); !s.ok()) Log(std::string(TierName(target->tier())) + " put", s);
  }

  // A batch of prefetches: disk first, then redis for what disk lacks; a
  // host hit needs no staging.
  void RunPrefetches(std::vector<Job>& jobs) {
    std::vector<BlockMeta> metas;
    {
      std::lock_guard lock(mu);
      for (Job& j : jobs) {
        if (staged.count(j.meta.key) == 0) metas.push_back(std::move(j.meta));
      }
    }
    for (BlockStore* s : {by_tier[2], by_tier[3]}) {
      if (s == nullptr || metas.empty()) continue;
      std::vector<std::vector<std::byte>> bufs(metas.size(), std::vector<std::byte>(static_cast<size_t>(kv_bytes)));
      std::vector<std::span<std::byte>> kvs(bufs.begin(), bufs.end());
      const int64_t corrupt_before = s->Stats().corrupt;
      Result<std::vector<bool>> got = s->GetMany(metas, kvs);
      if (!got.ok()) {
        Log(std::string(TierName(s->tier())) + " prefetch", got.status());
        continue;
      }
      if (const int64_t bad = s->Stats().corrupt - corrupt_before; bad > 0) {
        Log(std::string(TierName(s->tier())) + " prefetch",
            DataLossError(std::to_string(bad) + " block(s) failed their checks (checksum, size, key or tokens); dropped"));
      }
      std::vector<BlockMeta> missing;
      for (size_t i = 0; i < metas.size(); ++i) {
        if ((*got)[i]) {
          std::vector<std::byte> payload;
          tiers::EncodePayload(metas[i], bufs[i], tiers::PayloadSeal{}, payload);  // checked above; held in this process
          Stage(metas[i].key, std::move(payload), s->tier());
        } else {
          missing.push_back(std::move(metas[i]));
        }
      }
      metas = std::move(missing);
    }
  }

  // Background loads, in order, each through one worker-owned staging
  // buffer: the verified bytes reach the pool block by the job's store.
  void RunLoads(std::vector<Job>& jobs, BlockTiers& self) {
    std::vector<std::byte> staging(static_cast<size_t>(kv_bytes));
    for (Job& j : jobs) {
      if (o.before_background_load) o.before_background_load(j.meta);
      const std::optional<Tier> from = self.Load(j.meta, staging);
      if (from) j.load.store(staging);
      j.load.done(from);
    }
  }

  // Copies ahead of eviction: the block's bytes, then what Evicted does.
  void RunOffloads(std::vector<Job>& jobs, BlockTiers& self) {
    std::vector<std::byte> staging(static_cast<size_t>(kv_bytes));
    for (Job& j : jobs) {
      j.offload.read(staging);
      j.offload.done(self.Evicted(j.offload.meta, staging));
    }
  }

  void Work(BlockTiers& self) {
    constexpr size_t kBatch = 32;
    for (;;) {
      std::vector<Job> batch;
      {
        std::unique_lock lock(mu);
        work_cv.wait(lock, [&] { return stopping || !queue.empty() || !loads.empty(); });
        std::deque<Job>& from = !loads.empty() ? loads : queue;
        if (from.empty()) return;  // stopping, and all done
        // The front job and those right behind it of the same kind (and
        // target), up to a batch.
        batch.push_back(std::move(from.front()));
        from.pop_front();
        while (!from.empty() && batch.size() < kBatch && from.front().kind == batch.front().kind &&
               from.front().target == batch.front().target) {
          batch.push_back(std::move(from.front()));
          from.pop_front();
        }
        ++busy;
      }
      switch (batch.front().kind) {
        case Job::Kind::kPut: RunPuts(batch); break;
        case Job::Kind::kPrefetch: RunPrefetches(batch); break;
        case Job::Kind::kLoad: RunLoads(batch, self); break;
        case Job::Kind::kOffload: RunOffloads(batch, self); break;
      }
      std::lock_guard lock(mu);
      --busy;
      if (queue.empty() && loads.empty() && busy == 0) idle_cv.notify_all();
    }
  }
};

BlockTiers::BlockTiers(std::unique_ptr<State> state) : state_(std::move(state)) {}

BlockTiers::~BlockTiers() {
  Drain();
  {
    std::lock_guard lock(state_->mu);
    state_->stopping = true;
    state_->work_cv.notify_all();
  }
  for (std::thread& t : state_->workers) t.join();
}

Result<std::unique_ptr<BlockTiers>> BlockTiers::Create(const TierOptions& o, int32_t block_len, int64_t kv_bytes) {
  if (o.host_bytes < 0 || o.disk_bytes < 0) return InvalidArgumentError("tiers: sizes must not be negative");
  if (!TiersConfigured(o)) {
    return InvalidArgumentError("tiers: none configured (give --host-cache, --disk-cache, --redis or --redis-cluster)");
  }
  if (!o.redis_url.empty() && !o.redis_cluster.empty()) {
    return InvalidArgumentError("tiers: --redis (one server) and --redis-cluster (a cluster) are one tier: give one");
  }
  const bool redis = !o.redis_url.empty() || !o.redis_cluster.empty();
  if (!o.disk_path.empty() && o.disk_bytes == 0) {
    return InvalidArgumentError("tiers: --disk-cache needs --disk-cache-size");
  }
  if (o.queue_blocks < 1 || o.workers < 1 || o.workers > 64) {
    return InvalidArgumentError("tiers: queue_blocks must be at least 1 and workers within 1..64");
  }
  if (!o.payload_key.empty() && o.payload_key.size() < 16) {
    return InvalidArgumentError("tiers: the tier key has " + std::to_string(o.payload_key.size()) +
                                " bytes; give at least 16 (e.g. head -c 32 /dev/urandom | base64 > KEYFILE)");
  }
  if (o.payload_key.empty() && (!o.disk_path.empty() || redis) && o.log) {
    o.log("tiers: warning: no tier key (--tier-key-env / --tier-key-file): disk and Redis blocks carry a checksum, not "
          "a MAC, so anyone who can write the cache file or the Redis namespace can change the KV this process loads");
  }
  auto st = std::make_unique<State>();
  st->o = o;
  st->block_len = block_len;
  st->kv_bytes = kv_bytes;
  State* raw = st.get();
  auto sink = [raw](const TierChange& c) { raw->Record(c); };
  if (o.host_bytes > 0) {
    HostStoreOptions h{o.host_bytes, block_len, kv_bytes, nullptr, sink};
    if (!o.write_through) {
      // Write-back: a block pushed out of RAM goes one tier down.
      h.on_evict = [raw](const BlockMeta& meta, std::span<const std::byte> kv) {
        if (BlockStore* below = raw->Below(Tier::kHost)) raw->EnqueuePut(below, meta, kv);
      };
    }
    PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<BlockStore> s, CreateHostStore(h));
    st->stores.push_back(std::move(s));
  }
  if (!o.disk_path.empty()) {
    DiskStoreOptions d;
    d.path = o.disk_path;
    d.capacity_bytes = o.disk_bytes;
    d.block_len = block_len;
    d.kv_bytes = kv_bytes;
    d.direct_io = o.disk_direct_io;
    d.on_change = sink;
    d.payload_key = o.payload_key;
    PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<BlockStore> s, CreateDiskStore(d));
    st->stores.push_back(std::move(s));
  }
  if (redis) {
    RedisStoreOptions r;
    r.url = o.redis_url;
    r.cluster_nodes = o.redis_cluster;
    r.password = o.redis_password;
    if (!o.redis_namespace.empty()) r.key_namespace = o.redis_namespace;
    r.timeout_ms = o.redis_timeout_ms;
    r.ttl_seconds = o.redis_ttl_seconds;
    r.on_change = sink;
    r.payload_key = o.payload_key;
    PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<BlockStore> s, CreateRedisStore(r));
    st->stores.push_back(std::move(s));
  }
  for (auto& s : st->stores) st->by_tier[static_cast<int>(s->tier())] = s.get();
  std::unique_ptr<BlockTiers> tiers(new BlockTiers(std::move(st)));
  BlockTiers* self = tiers.get();
  for (int i = 0; i < o.workers; ++i) raw->workers.emplace_back([raw, self] { raw->Work(*self); });
  return tiers;
}

std::vector<Tier> BlockTiers::LocatePrefix(std::span<const BlockKey> keys) {
  State& st = *state_;
  std::vector<Tier> where(keys.size(), Tier::kPool);  // kPool = not found yet
  size_t first_unknown = keys.size();
  for (size_t i = 0; i < keys.size(); ++i) {
    {
      std::lock_guard lock(st.mu);
      if (auto it = st.staged.find(keys[i]); it != st.staged.end()) where[i] = it->second.from;
    }
    for (int t = 1; t <= 2 && where[i] == Tier::kPool; ++t) {
      BlockStore* s = st.by_tier[t];
      if (s == nullptr) continue;
      if (Result<bool> has = s->Contains(keys[i]); has.ok() && *has) where[i] = s->tier();
    }
    if (where[i] == Tier::kPool && first_unknown == keys.size()) first_unknown = i;
  }
  if (BlockStore* redis = st.by_tier[3]; redis != nullptr && first_unknown < keys.size()) {
    Result<std::vector<bool>> has = redis->ContainsMany(keys.subspan(first_unknown));
    if (has.ok()) {
      for (size_t i = first_unknown; i < keys.size(); ++i) {
        if (where[i] == Tier::kPool && (*has)[i - first_unknown]) where[i] = Tier::kRedis;
      }
    } else {
      st.Log("redis lookup", has.status());
    }
  }
  size_t n = 0;
  while (n < where.size() && where[n] != Tier::kPool) ++n;
  where.resize(n);
  return where;
}

std::optional<Tier> BlockTiers::Load(const BlockMeta& meta, std::span<std::byte> kv) {
  State& st = *state_;
  {
    std::lock_guard lock(st.mu);
    if (auto it = st.staged.find(meta.key); it != st.staged.end()) {
      // Checked like a store's payload, against this request's tokens,
      // parent and geometry: the request that asked for the prefetch may
      // have had other tokens under the same key.
      const Tier from = it->second.from;
      const bool ok = tiers::DecodePayload(it->second.payload, meta, kv, tiers::PayloadSeal{}).ok();
      st.staged.erase(it);  // the pool holds it from now on, or it was not this request's (its order entry ages out)
      if (ok) {
        ++st.load_hits[static_cast<int>(from)];
        return from;
      }
      ++st.staged_mismatches;
    }
  }
  for (int t = 1; t < kNumTiers; ++t) {
    BlockStore* s = st.by_tier[t];
    if (s == nullptr) continue;
    const int64_t corrupt_before = s->Stats().corrupt;
    Result<bool> got = s->Get(meta, kv);
    if (!got.ok()) {
      st.Log(std::string(TierName(s->tier())) + " get", got.status());
      continue;  // the block may also be further down
    }
    if (!*got) {
      if (s->Stats().corrupt > corrupt_before) {
        st.Log(std::string(TierName(s->tier())) + " get",
               DataLossError("block " + meta.key.Hex().substr(0, 16) + " failed its checks (checksum, size, key or "
                             "tokens); dropped"));
      }
      continue;
    }
    std::lock_guard lock(st.mu);
    ++st.load_hits[t];
    return s->tier();
  }
  std::lock_guard lock(st.mu);
  ++st.load_failures;
  return std::nullopt;
}

bool BlockTiers::write_through() const { return state_->o.write_through; }

void BlockTiers::Published(const BlockMeta& meta, std::span<const std::byte> kv) {
  if (!state_->o.write_through) return;
  for (int t = 2; t < kNumTiers; ++t) {  // the pool holds it; RAM gets it on eviction
    if (BlockStore* s = state_->by_tier[t]) state_->EnqueuePut(s, meta, kv);
  }
}

std::optional<Tier> BlockTiers::Evicted(const BlockMeta& meta, std::span<const std::byte> kv) {
  State& st = *state_;
  if (BlockStore* host = st.by_tier[1]) {
    if (Status s = host->Put(meta, kv); s.ok()) return Tier::kHost;
    else st.Log("host put", s);
  }
  BlockStore* below = st.Below(Tier::kHost);
  if (below == nullptr) return std::nullopt;
  if (st.o.write_through) return below->tier();  // written when published
  st.EnqueuePut(below, meta, kv);
  return below->tier();
}

void BlockTiers::Prefetch(std::vector<BlockMeta> metas) {
  if (state_->by_tier[2] == nullptr && state_->by_tier[3] == nullptr) return;
  for (BlockMeta& m : metas) {
    Job j;
    j.kind = Job::Kind::kPrefetch;
    j.meta = std::move(m);
    if (!state_->Enqueue(std::move(j))) break;
  }
}

void BlockTiers::StartLoads(std::vector<TierLoadJob> jobs) {
  State& st = *state_;
  std::lock_guard lock(st.mu);
  for (TierLoadJob& l : jobs) {
    Job j;
    j.kind = Job::Kind::kLoad;
    j.meta = l.meta;
    j.load = std::move(l);
    st.loads.push_back(std::move(j));
    ++st.background_loads;
  }
  st.work_cv.notify_all();
}

void BlockTiers::StartOffloads(std::vector<TierOffloadJob> jobs) {
  State& st = *state_;
  std::vector<TierOffloadJob> refused;
  {
    std::lock_guard lock(st.mu);
    for (TierOffloadJob& f : jobs) {
      if (static_cast<int64_t>(st.queue.size()) >= st.o.queue_blocks) {
        ++st.dropped;
        refused.push_back(std::move(f));
        continue;
      }
      Job j;
      j.kind = Job::Kind::kOffload;
      j.offload = std::move(f);
      st.queue.push_back(std::move(j));
      ++st.offloads;
    }
    st.work_cv.notify_all();
  }
  for (TierOffloadJob& f : refused) f.done(std::nullopt);  // its eviction copies it then
}

bool BlockTiers::StillHolds(const BlockKey& key, Tier tier) {
  if (tier != Tier::kHost) return true;  // as Evicted's answer for the slower tiers
  BlockStore* host = state_->by_tier[static_cast<int>(Tier::kHost)];
  if (host == nullptr) return false;
  Result<bool> has = host->Contains(key);
  return has.ok() && *has;
}

void BlockTiers::RecordChanges(bool on) {
  State& st = *state_;
  st.record.store(on);
  if (!on) {
    std::lock_guard lock(st.changes_mu);
    st.changes.clear();
  }
}

std::vector<TierChange> BlockTiers::TakeChanges() {
  State& st = *state_;
  std::lock_guard lock(st.changes_mu);
  std::vector<TierChange> out(std::make_move_iterator(st.changes.begin()), std::make_move_iterator(st.changes.end()));
  st.changes.clear();
  return out;
}

void BlockTiers::Drain() {
  State& st = *state_;
  {
    std::unique_lock lock(st.mu);
    st.idle_cv.wait(lock, [&] { return st.queue.empty() && st.loads.empty() && st.busy == 0; });
  }
  for (auto& s : st.stores) {
    if (Status f = s->Flush(); !f.ok()) st.Log(std::string(TierName(s->tier())) + " flush", f);
  }
}

void BlockTiers::CheckInvariants() const {
  for (const auto& store : state_->stores) store->CheckInvariants();
}

TiersStats BlockTiers::Stats() const {
  const State& st = *state_;
  TiersStats out;
  for (const auto& s : st.stores) out.tiers.push_back(s->Stats());
  std::lock_guard lock(state_->mu);
  out.queued_now = static_cast<int64_t>(st.queue.size());
  out.dropped = st.dropped;
  out.prefetched = st.prefetched;
  for (int t = 0; t < kNumTiers; ++t) out.load_hits[t] = st.load_hits[t];
  out.load_failures = st.load_failures;
  out.staged_mismatches = st.staged_mismatches;
  out.background_loads = st.background_loads;
  out.offloads = st.offloads;
  {
    std::lock_guard changes_lock(state_->changes_mu);
    out.dropped_changes = st.dropped_changes;
  }
  return out;
}

BlockStore* BlockTiers::store(Tier t) { return state_->by_tier[static_cast<int>(t)]; }

}  // namespace pagekv
