// The KV tiers from Python (pagekv/tiers.h): one store at a time (host RAM,
// disk file, Redis) with put / get / contains on whole block payloads, the
// BlockMeta naming what a payload is (PrefixCache.block_metas makes them),
// and BlockTiers joining the stores under a PrefixCache. Every call that can
// wait on I/O (disk, Redis, the tiers' queues) releases the GIL; the
// arguments are converted before and the results built after.
#include "tiers.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <span>
#include <variant>

#include "buffer.h"
#include "config.h"
#include "errors.h"
#include "gil.h"
#include "kv_cache.h"
#include "pagekv/tiers.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace pagekv::python {
namespace {

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

BlockKey KeyFromHex(const std::string& hex) {
  if (hex.size() != 32 && hex.size() != 64) {
    RaiseInvalid("key \"" + hex.substr(0, 80) + "\": 32 or 64 hex digits (a block key as PrefixCache.keys gives it)");
  }
  BlockKey k;
  k.size = static_cast<uint8_t>(hex.size() / 2);
  for (size_t i = 0; i < k.size; ++i) {
    const int hi = HexDigit(hex[2 * i]), lo = HexDigit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) RaiseInvalid("key \"" + hex.substr(0, 80) + "\": not hexadecimal at digit " + std::to_string(2 * i));
    k.bytes[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  return k;
}

using KeyArg = std::variant<BlockMeta, std::string>;


BlockKey KeyOf(const KeyArg& a) {
  if (const auto* m = std::get_if<BlockMeta>(&a)) return m->key;
  return KeyFromHex(std::get<std::string>(a));
}

nb::dict TierStatsDict(const TierStats& s) {
  nb::dict d;
  d["name"] = s.name;
  d["puts"] = s.puts;
  d["gets"] = s.gets;
  d["hits"] = s.hits;
  d["misses"] = s.misses;
  d["evictions"] = s.evictions;
  d["corrupt"] = s.corrupt;
  d["unauthenticated"] = s.unauthenticated;
  d["errors"] = s.errors;
  d["blocks_now"] = s.blocks_now;
  d["bytes_now"] = s.bytes_now;
  d["capacity_bytes"] = s.capacity_bytes;
  d["healthy"] = s.healthy;
  return d;
}

// A store, owned or borrowed from a Tiers object (which `owner` keeps alive).
class PyBlockStore {
 public:
  explicit PyBlockStore(std::unique_ptr<BlockStore> store, int64_t kv_bytes)
      : owned_(std::move(store)), store_(owned_.get()), kv_bytes_(kv_bytes) {}
  PyBlockStore(BlockStore* store, int64_t kv_bytes, nb::object owner)
      : store_(store), kv_bytes_(kv_bytes), owner_(std::move(owner)) {}
  PyBlockStore(PyBlockStore&&) = default;
  PyBlockStore& operator=(PyBlockStore&&) = delete;
  ~PyBlockStore() {
    // A disk or Redis store may wait on I/O while closing (the index written).
    nb::gil_scoped_release release;
    owned_.reset();
  }

  BlockStore& get() const { return *store_; }
  int64_t kv_bytes() const { return kv_bytes_; }

  void Put(const BlockMeta& meta, nb::handle data) {
    Buffer buf(data, "data");
    CheckSize(buf.bytes().size());
    Check(Released([&] { return store_->Put(meta, buf.bytes()); }));
  }

  nb::object Get(const BlockMeta& meta) {
    nb::bytes out = MakeBytes();
    const std::span<std::byte> into = Writable(out);
    return Take(Released([&] { return store_->Get(meta, into); })) ? nb::object(out) : nb::none();
  }

  bool Contains(const KeyArg& key) {
    const BlockKey k = KeyOf(key);
    return Take(Released([&] { return store_->Contains(k); }));
  }

  std::vector<bool> ContainsMany(const std::vector<KeyArg>& keys) {
    std::vector<BlockKey> ks;
    for (const KeyArg& k : keys) ks.push_back(KeyOf(k));
    return Take(Released([&] { return store_->ContainsMany(ks); }));
  }

  void PutMany(const std::vector<BlockMeta>& metas, const std::vector<nb::object>& datas) {
    if (metas.size() != datas.size()) {
      RaiseInvalid("put_many: " + std::to_string(metas.size()) + " metas and " + std::to_string(datas.size()) +
                   " payloads; one payload per meta");
    }
    std::vector<std::unique_ptr<Buffer>> bufs;
    std::vector<std::span<const std::byte>> spans;
    for (const nb::object& d : datas) {
      bufs.push_back(std::make_unique<Buffer>(d, "data"));
      CheckSize(bufs.back()->bytes().size());
      spans.push_back(bufs.back()->bytes());
    }
    Check(Released([&] { return store_->PutMany(metas, spans); }));
  }

  std::vector<nb::object> GetMany(const std::vector<BlockMeta>& metas) {
    std::vector<nb::bytes> outs;
    std::vector<std::span<std::byte>> spans;
    for (size_t i = 0; i < metas.size(); ++i) {
      outs.push_back(MakeBytes());
      spans.push_back(Writable(outs.back()));
    }
    const std::vector<bool> got = Take(Released([&] { return store_->GetMany(metas, spans); }));
    std::vector<nb::object> result;
    for (size_t i = 0; i < metas.size(); ++i) result.push_back(got[i] ? nb::object(outs[i]) : nb::none());
    return result;
  }

  void Remove(const KeyArg& key) {
    const BlockKey k = KeyOf(key);
    Check(Released([&] { return store_->Remove(k); }));
  }

  void Flush() {
    Check(Released([&] { return store_->Flush(); }));
  }

 private:
  void CheckSize(size_t n) const {
    if (static_cast<int64_t>(n) != kv_bytes_) {
      RaiseInvalid("data: " + std::to_string(n) + " bytes, a block's payload here is " + std::to_string(kv_bytes_) +
                   " (KvCache.block_payload_bytes; KvCache.read_block gives one)");
    }
  }
  nb::bytes MakeBytes() const {
    PyObject* b = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(kv_bytes_));
    if (b == nullptr) throw nb::python_error();
    return nb::steal<nb::bytes>(b);
  }
  // A bytes object just made and not yet shared: filled in place.
  static std::span<std::byte> Writable(nb::bytes& b) {
    return {reinterpret_cast<std::byte*>(PyBytes_AS_STRING(b.ptr())), static_cast<size_t>(PyBytes_GET_SIZE(b.ptr()))};
  }

  std::unique_ptr<BlockStore> owned_;
  BlockStore* store_ = nullptr;
  int64_t kv_bytes_ = 0;
  nb::object owner_;
};

// block_len and kv_bytes: from a cache, or given.
std::pair<int32_t, int64_t> Shape(PyKvCache* cache, std::optional<int32_t> block_len, std::optional<int64_t> kv_bytes) {
  if (cache != nullptr) {
    if (block_len || kv_bytes) RaiseInvalid("give either cache or block_len and kv_bytes, not both");
    return {cache->cache().layout().block_len(), cache->cache().block_payload_bytes()};
  }
  if (!block_len || !kv_bytes) {
    RaiseInvalid("the blocks' shape is needed: cache=<KvCache>, or block_len and kv_bytes "
                 "(KvCache.block_len and KvCache.block_payload_bytes)");
  }
  if (*block_len <= 0 || *kv_bytes <= 0) {
    RaiseInvalid("block_len " + std::to_string(*block_len) + ", kv_bytes " + std::to_string(*kv_bytes) +
                 ": both must be positive");
  }
  return {*block_len, *kv_bytes};
}

std::string KeyText(const std::optional<std::string>& key) { return key.value_or(""); }

class PyTiers {
 public:
  PyTiers(const TierOptions& options, int32_t block_len, int64_t kv_bytes) : block_len_(block_len), kv_bytes_(kv_bytes) {
    tiers_ = Take(Released([&] { return BlockTiers::Create(options, block_len, kv_bytes); }));
  }
  ~PyTiers() {
    nb::gil_scoped_release release;  // finishes queued work
    tiers_.reset();
  }
  BlockTiers& get() { return *tiers_; }
  int64_t kv_bytes() const { return kv_bytes_; }
  int32_t block_len() const { return block_len_; }

 private:
  std::unique_ptr<BlockTiers> tiers_;
  int32_t block_len_ = 0;
  int64_t kv_bytes_ = 0;
};

nb::dict TiersStatsDict(const TiersStats& s) {
  nb::dict d;
  std::vector<nb::dict> tiers;
  for (const TierStats& t : s.tiers) tiers.push_back(TierStatsDict(t));
  d["tiers"] = tiers;
  d["queued_now"] = s.queued_now;
  d["dropped"] = s.dropped;
  d["prefetched"] = s.prefetched;
  nb::dict loads;
  for (int t = 0; t < kNumTiers; ++t) loads[TierName(static_cast<Tier>(t))] = s.load_hits[t];
  d["load_hits"] = loads;
  d["load_failures"] = s.load_failures;
  d["staged_mismatches"] = s.staged_mismatches;
  d["dropped_changes"] = s.dropped_changes;
  d["background_loads"] = s.background_loads;
  d["offloads"] = s.offloads;
  return d;
}

}  // namespace

LowerTiers* TiersOf(nb::handle tiers, const KvCache& cache) {
  PyTiers& t = nb::cast<PyTiers&>(tiers);
  if (t.block_len() != cache.layout().block_len() || t.kv_bytes() != cache.block_payload_bytes()) {
    RaiseInvalid("tiers: made for blocks of " + std::to_string(t.block_len()) + " tokens and " +
                 std::to_string(t.kv_bytes()) + " bytes, this cache's are " +
                 std::to_string(cache.layout().block_len()) + " tokens and " +
                 std::to_string(cache.block_payload_bytes()) + " bytes: make the Tiers with this cache");
  }
  return &t.get();
}

void BindTiers(nb::module_& m) {
  nb::class_<BlockMeta>(m, "BlockMeta",
                        "What a stored block is: its key, its parent's key (None for a chain's first block), its\n"
                        "token ids, the cache geometry tag and the prefix digest. A store's get returns a payload\n"
                        "only if every field matches what was put. Made by PrefixCache.block_metas.")
      .def_prop_ro("key", [](const BlockMeta& b) { return b.key.Hex(); })
      .def_prop_ro("parent", [](const BlockMeta& b) { return b.parent ? std::optional<std::string>(b.parent->Hex()) : std::nullopt; })
      .def_prop_ro("tokens", [](const BlockMeta& b) { return b.tokens; })
      .def_prop_ro("geometry", [](const BlockMeta& b) { return b.geometry; })
      .def_prop_ro("digest", [](const BlockMeta& b) { return b.digest.Hex(); })
      .def("__repr__", [](const BlockMeta& b) {
        return "BlockMeta(key=" + b.key.Hex().substr(0, 16) + "..., " + std::to_string(b.tokens.size()) + " tokens" +
               (b.parent ? ", parent=" + b.parent->Hex().substr(0, 16) + "...)" : ", first)");
      });

  nb::class_<PyBlockStore>(
      m, "BlockStore",
      "One KV tier holding whole blocks (KvCache.read_block's bytes) under their BlockMeta: a payload is\n"
      "sealed (an xxh3 checksum, or HMAC-SHA-256 under payload_key) with its meta, and get returns it\n"
      "only when seal and meta match (a corrupt, foreign or forged payload is a miss, counted, and\n"
      "dropped). Made by HostStore, DiskStore, RedisStore or Tiers.store. Calls release the GIL.")
      .def_prop_ro("tier", [](const PyBlockStore& s) { return std::string(TierName(s.get().tier())); })
      .def_prop_ro("kv_bytes", &PyBlockStore::kv_bytes, "The payload size every put and get moves.")
      .def_prop_ro("capacity_bytes", [](const PyBlockStore& s) { return s.get().capacity_bytes(); })
      .def("put", &PyBlockStore::Put, "meta"_a, "data"_a,
           "Stores (or replaces) the block; may evict older ones (host, disk: LRU). data: kv_bytes bytes.")
      .def("get", &PyBlockStore::Get, "meta"_a,
           "The block's payload as bytes, or None (not held, or it failed a check and was dropped).")
      .def("contains", &PyBlockStore::Contains, "key"_a, "Whether the store holds the key (a BlockMeta or its hex key).")
      .def("__contains__", &PyBlockStore::Contains, "key"_a)
      .def("contains_many", &PyBlockStore::ContainsMany, "keys"_a, "contains for each key (Redis: one round trip).")
      .def("put_many", &PyBlockStore::PutMany, "metas"_a, "datas"_a,
           "put for each (Redis: one pipelined round trip); stops at the first error.")
      .def("get_many", &PyBlockStore::GetMany, "metas"_a, "get for each (Redis: one pipelined round trip).")
      .def("remove", &PyBlockStore::Remove, "key"_a, "Drops the block (a BlockMeta or its hex key) if held.")
      .def("flush", &PyBlockStore::Flush, "Makes what was stored durable (disk: writes the index).")
      .def("stats", [](const PyBlockStore& s) { return TierStatsDict(s.get().Stats()); },
           "Counters: puts, gets, hits, misses, evictions, corrupt, unauthenticated, errors, blocks_now, ...")
      .def("check_invariants", [](const PyBlockStore& s) { s.get().CheckInvariants(); },
           "Aborts the process if the store's index, LRU and free slots disagree (a library bug, for tests).");

  m.def(
      "HostStore",
      [](int64_t capacity_bytes, PyKvCache* cache, std::optional<int32_t> block_len, std::optional<int64_t> kv_bytes,
         std::optional<std::string> payload_key) {
        const auto [bl, kv] = Shape(cache, block_len, kv_bytes);
        HostStoreOptions o;
        o.capacity_bytes = capacity_bytes;
        o.block_len = bl;
        o.kv_bytes = kv;
        o.payload_key = KeyText(payload_key);
        return PyBlockStore(Take(CreateHostStore(o)), kv);
      },
      "capacity_bytes"_a, nb::kw_only(), "cache"_a = nb::none(), "block_len"_a = nb::none(), "kv_bytes"_a = nb::none(),
      "payload_key"_a = nb::none(),
      "A block store in RAM: one preallocated arena of capacity_bytes in fixed-size slots, least recently\n"
      "used out. The blocks' shape from cache, or block_len and kv_bytes.");
  m.def(
      "DiskStore",
      [](const std::string& path, int64_t capacity_bytes, PyKvCache* cache, std::optional<int32_t> block_len,
         std::optional<int64_t> kv_bytes, bool direct_io, std::optional<std::string> payload_key) {
        const auto [bl, kv] = Shape(cache, block_len, kv_bytes);
        DiskStoreOptions o;
        o.path = path;
        o.capacity_bytes = capacity_bytes;
        o.block_len = bl;
        o.kv_bytes = kv;
        o.direct_io = direct_io;
        o.payload_key = KeyText(payload_key);
        return PyBlockStore(Take(Released([&] { return CreateDiskStore(o); })), kv);
      },
      "path"_a, "capacity_bytes"_a, nb::kw_only(), "cache"_a = nb::none(), "block_len"_a = nb::none(),
      "kv_bytes"_a = nb::none(), "direct_io"_a = true, "payload_key"_a = nb::none(),
      "A block store in one preallocated file (created 0600; an existing one must be this user's, closed\n"
      "to others and of the same geometry) with an index beside it, so blocks survive a restart (flush()\n"
      "writes the index; closing does too).");
  m.def(
      "RedisStore",
      [](const std::string& url, PyKvCache* cache, std::optional<int32_t> block_len, std::optional<int64_t> kv_bytes,
         std::optional<std::string> password, const std::string& key_namespace, int timeout_ms, int64_t ttl_seconds,
         std::optional<std::string> payload_key) {
        const auto [bl, kv] = Shape(cache, block_len, kv_bytes);
        (void)bl;
        RedisStoreOptions o;
        o.url = url;
        o.password = password.value_or("");
        o.key_namespace = key_namespace;
        o.timeout_ms = timeout_ms;
        o.ttl_seconds = ttl_seconds;
        o.payload_key = KeyText(payload_key);
        return PyBlockStore(Take(CreateRedisStore(o)), kv);
      },
      "url"_a, nb::kw_only(), "cache"_a = nb::none(), "block_len"_a = nb::none(), "kv_bytes"_a = nb::none(),
      "password"_a = nb::none(), "namespace"_a = "pagekv", "timeout_ms"_a = 500, "ttl_seconds"_a = 0,
      "payload_key"_a = nb::none(),
      "A block store on a redis-server (redis://host[:port][/db]; keys \"<namespace>:<key hex>\"). Connects\n"
      "on first use; a server that is down makes calls fail with UnavailableError and is retried with\n"
      "backoff. Give the password here, never in the url.");

  nb::class_<PyTiers>(
      m, "Tiers",
      "The lower tiers under a PrefixCache (PrefixCache(cache, tiers=...)): blocks evicted from the pool\n"
      "go down to RAM, disk, Redis (published ones written through to disk and Redis), and a prefix that\n"
      "continues there is loaded instead of recomputed. Moves run on the tiers' own threads.")
      .def(
          "__init__",
          [](PyTiers* self, PyKvCache& cache, int64_t host_bytes, std::optional<std::string> disk_path,
             int64_t disk_bytes, bool disk_direct_io, std::optional<std::string> redis_url,
             std::optional<std::string> redis_password, const std::string& redis_namespace, int redis_timeout_ms,
             int64_t redis_ttl_seconds, bool write_through, std::optional<std::string> payload_key,
             int64_t queue_blocks, int workers) {
            TierOptions o;
            o.host_bytes = host_bytes;
            o.disk_path = disk_path.value_or("");
            o.disk_bytes = disk_bytes;
            o.disk_direct_io = disk_direct_io;
            o.redis_url = redis_url.value_or("");
            o.redis_password = redis_password.value_or("");
            o.redis_namespace = redis_namespace;
            o.redis_timeout_ms = redis_timeout_ms;
            o.redis_ttl_seconds = redis_ttl_seconds;
            o.write_through = write_through;
            o.payload_key = KeyText(payload_key);
            o.queue_blocks = queue_blocks;
            o.workers = workers;
            new (self) PyTiers(o, cache.cache().layout().block_len(), cache.cache().block_payload_bytes());
          },
          "cache"_a, nb::kw_only(), "host_bytes"_a = 0, "disk_path"_a = nb::none(), "disk_bytes"_a = 0,
          "disk_direct_io"_a = true, "redis_url"_a = nb::none(), "redis_password"_a = nb::none(),
          "redis_namespace"_a = "", "redis_timeout_ms"_a = 500, "redis_ttl_seconds"_a = 0, "write_through"_a = true,
          "payload_key"_a = nb::none(), "queue_blocks"_a = 1024, "workers"_a = 1,
          "Tiers for cache's blocks: any of host_bytes (RAM), disk_path + disk_bytes, redis_url.")
      .def(
          "drain",
          [](PyTiers& t) {
            nb::gil_scoped_release release;
            t.get().Drain();
          },
          "Waits until every queued put and prefetch is done; flushes the stores.")
      .def("stats", [](PyTiers& t) { return TiersStatsDict(t.get().Stats()); }, "Every store's counters and the queues'.")
      .def(
          "store",
          [](nb::handle self, const std::string& name) {
            PyTiers& t = nb::cast<PyTiers&>(self);
            Tier tier;
            if (name == "host") {
              tier = Tier::kHost;
            } else if (name == "disk") {
              tier = Tier::kDisk;
            } else if (name == "redis") {
              tier = Tier::kRedis;
            } else {
              RaiseInvalid("tier \"" + name + "\": \"host\", \"disk\" or \"redis\"");
            }
            BlockStore* s = t.get().store(tier);
            if (s == nullptr) Raise(Status(StatusCode::kNotFound, "no " + name + " tier is configured"));
            return PyBlockStore(s, t.kv_bytes(), nb::borrow(self));
          },
          "name"_a, "One configured store (\"host\", \"disk\", \"redis\"), sharing the tiers (kept alive by it).")
      .def("check_invariants", [](PyTiers& t) { t.get().CheckInvariants(); });
}

}  // namespace pagekv::python
