// pagekv.PrefixCache: hash-chained prefix caching over a KvCache
// (pagekv/prefix_cache.h): lookup / admit / publish with a tenant's salt and
// extra keys, statistics, and the KV events as dicts.
#include "prefix_cache.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "errors.h"
#include "kv_cache.h"
#include "pagekv/prefix_cache.h"
#include "tiers.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace pagekv::python {
namespace {

class PyPrefixCache {
 public:
  PyPrefixCache(PyKvCache& cache, const std::string& hash, std::optional<uint64_t> seed, bool record_events,
                nb::handle tiers) {
    PrefixCacheOptions options;
    if (hash == "sha256") {
      options.hasher.kind = BlockHashKind::kSha256;
      if (seed) RaiseInvalid("seed: only the xxh3 hash takes a seed (SHA-256 keys are unkeyed)");
    } else if (hash == "xxh3") {
      options.hasher.kind = BlockHashKind::kXxh3_128;
      options.hasher.seed = seed;
    } else {
      RaiseInvalid("hash \"" + hash + "\": \"sha256\" or \"xxh3\"");
    }
    options.record_events = record_events;
    if (!tiers.is_none()) options.tiers = TiersOf(tiers, cache.cache());
    cache_ = Take(PrefixCache::Create(cache.cache(), options));
  }
  PrefixCache& get() { return *cache_; }
  const PrefixCache& get() const { return *cache_; }

 private:
  std::unique_ptr<PrefixCache> cache_;  // its KvCache is kept alive by the Python object (keep_alive)
};

ExtraKeys Extra(std::optional<std::string> salt, int64_t adapter_id, const std::string& fingerprint,
                const std::vector<std::string>& extra) {
  ExtraKeys e;
  e.cache_salt = std::move(salt);
  e.adapter_id = adapter_id;
  e.model_fingerprint = fingerprint;
  e.extra = extra;
  Check(PrefixCache::ValidateExtraKeys(e));
  return e;
}

std::vector<int32_t> Blocks(const std::vector<BlockId>& blocks) {
  std::vector<int32_t> out;
  for (BlockId b : blocks) out.push_back(ToInt(b));
  return out;
}

std::vector<std::string> Hexes(const std::vector<BlockKey>& keys) {
  std::vector<std::string> out;
  for (const BlockKey& k : keys) out.push_back(k.Hex());
  return out;
}

nb::dict StatsDict(const PrefixCacheStats& s) {
  nb::dict d;
  d["lookups"] = s.lookups;
  d["requested_tokens"] = s.requested_tokens;
  d["requested_blocks"] = s.requested_blocks;
  d["hit_tokens"] = s.hit_tokens;
  d["hit_blocks"] = s.hit_blocks;
  d["inserted"] = s.inserted;
  d["evicted"] = s.evicted;
  d["collisions"] = s.collisions;
  d["cached_blocks"] = s.cached_blocks;
  d["token_hit_rate"] = s.token_hit_rate;
  d["block_hit_rate"] = s.block_hit_rate;
  d["recent_token_hit_rate"] = s.recent_token_hit_rate;
  d["recent_block_hit_rate"] = s.recent_block_hit_rate;
  return d;
}

nb::dict EventDict(const KvEvent& e) {
  nb::dict d;
  d["type"] = e.type == KvEvent::Type::kBlockStored    ? "BlockStored"
              : e.type == KvEvent::Type::kBlockRemoved ? "BlockRemoved"
                                                       : "AllBlocksCleared";
  d["sequence"] = e.sequence;
  d["keys"] = Hexes(e.keys);
  d["parent"] = e.parent ? nb::cast(e.parent->Hex()) : nb::none();
  d["token_ids"] = e.token_ids;
  d["block_len"] = e.block_len;
  d["adapter_id"] = e.adapter_id;
  d["extra_keys"] = e.extra_keys;
  d["tier"] = e.tier;
  return d;
}

// The keyword arguments every request-shaped call takes.
#define PAGEKV_EXTRA_ARGS                                                                               \
  nb::kw_only(), "salt"_a = nb::none(), "adapter_id"_a = 0, "model_fingerprint"_a = "", \
      "extra_keys"_a = std::vector<std::string>{}

}  // namespace

void BindPrefixCache(nb::module_& m) {
  nb::class_<PyPrefixCache>(
      m, "PrefixCache",
      "Prefix caching over a KvCache: full blocks published under a content key chained from the\n"
      "first block (salt and extra keys enter the first key, so different salts never share a block),\n"
      "found again by later requests whose tokens start the same way, shared by reference count.\n"
      "A hit needs equal token ids and prefix digests, never a hash alone. Keeps its KvCache alive.")
      .def(nb::init<PyKvCache&, const std::string&, std::optional<uint64_t>, bool, nb::handle>(), "cache"_a,
           nb::kw_only(), "hash"_a = "sha256", "seed"_a = nb::none(), "record_events"_a = false,
           "tiers"_a = nb::none(), nb::keep_alive<1, 2>(), nb::keep_alive<1, 6>(),
           "hash: \"sha256\" (default) or \"xxh3\" (xxh3-128, seeded; random per process unless seed is\n"
           "given; give a seed for keys other processes and restarts can find in disk or Redis tiers);\n"
           "record_events: queue KV events for events(); tiers: a pagekv.Tiers of this cache's blocks (kept\n"
           "alive), where evicted blocks go and prefixes continue.")
      .def(
          "lookup",
          [](const PyPrefixCache& p, const std::vector<int32_t>& tokens, std::optional<std::string> salt,
             int64_t adapter_id, const std::string& fingerprint, const std::vector<std::string>& extra,
             int64_t max_tokens) {
            const PrefixMatch match =
                Take(p.get().Lookup(tokens, Extra(std::move(salt), adapter_id, fingerprint, extra), max_tokens));
            nb::dict d;
            d["blocks"] = Blocks(match.blocks);
            d["num_tokens"] = match.num_tokens;
            d["keys"] = Hexes(match.keys);
            return d;
          },
          "tokens"_a, PAGEKV_EXTRA_ARGS, "max_tokens"_a = -1,
          "The longest cached prefix of tokens (within max_tokens; negative: all but the last token, which\n"
          "is always computed), changing nothing: {blocks, num_tokens, keys}.")
      .def(
          "admit",
          [](PyPrefixCache& p, const std::vector<int32_t>& tokens, std::optional<std::string> salt,
             int64_t adapter_id, const std::string& fingerprint, const std::vector<std::string>& extra,
             const std::string& label, int64_t max_tokens) {
            const PrefixCache::Admitted a = Take(p.get().AddSequence(
                tokens, Extra(std::move(salt), adapter_id, fingerprint, extra), label, max_tokens));
            return std::make_pair(ToInt(a.seq), a.match.num_tokens);
          },
          "tokens"_a, PAGEKV_EXTRA_ARGS, "label"_a = "", "max_tokens"_a = -1,
          "A new sequence in the KvCache starting with the longest cached prefix of tokens (its blocks\n"
          "claimed, so nothing can evict them): (sequence id, tokens already cached). Append the rest.")
      .def(
          "publish",
          [](PyPrefixCache& p, int64_t seq, const std::vector<int32_t>& tokens) {
            Check(p.get().Publish(SeqId{seq}, tokens));
          },
          "seq"_a, "tokens"_a,
          "Publishes every block of seq that became full since the last call; tokens are the sequence's\n"
          "token ids (at least its length).")
      .def("fork", [](PyPrefixCache& p, int64_t seq, const std::string& label) { return ToInt(Take(p.get().Fork(SeqId{seq}, label))); },
           "seq"_a, "label"_a = "", "KvCache.fork that also copies the sequence's key chain.")
      .def("free", [](PyPrefixCache& p, int64_t seq) { Check(p.get().Free(SeqId{seq})); }, "seq"_a,
           "Frees the sequence; its published blocks stay cached (evictable).")
      .def("clear", [](PyPrefixCache& p) { p.get().Clear(); }, "Drops every key (blocks in use are untouched).")
      .def("stats", [](const PyPrefixCache& p) { return StatsDict(p.get().Stats()); }, "Hit counters and rates.")
      .def(
          "keys",
          [](const PyPrefixCache& p, const std::vector<int32_t>& tokens, std::optional<std::string> salt,
             int64_t adapter_id, const std::string& fingerprint, const std::vector<std::string>& extra) {
            return Hexes(Take(p.get().Keys(tokens, Extra(std::move(salt), adapter_id, fingerprint, extra))));
          },
          "tokens"_a, PAGEKV_EXTRA_ARGS, "The content keys (hex) of the full blocks of tokens.")
      .def(
          "block_metas",
          [](const PyPrefixCache& p, const std::vector<int32_t>& tokens, std::optional<std::string> salt,
             int64_t adapter_id, const std::string& fingerprint, const std::vector<std::string>& extra,
             int64_t max_blocks) {
            return Take(p.get().BlockMetas(tokens, Extra(std::move(salt), adapter_id, fingerprint, extra), max_blocks));
          },
          "tokens"_a, PAGEKV_EXTRA_ARGS, "max_blocks"_a = -1,
          "What a BlockStore keeps each full block of tokens under (key, parent, tokens, geometry, prefix\n"
          "digest), as the tiers get them from this cache: for moving blocks by hand with\n"
          "KvCache.read_block / write_block and a store's put / get.")
      .def(
          "events",
          [](PyPrefixCache& p) {
            std::vector<nb::dict> out;
            for (const KvEvent& e : p.get().DrainEvents()) out.push_back(EventDict(e));
            return out;
          },
          "The KV events queued since the last call (record_events=True), oldest first, as dicts in\n"
          "vLLM's terms: BlockStored (keys, parent, token_ids, block_len, extra_keys), BlockRemoved,\n"
          "AllBlocksCleared.")
      .def_prop_ro("dropped_events", [](const PyPrefixCache& p) { return p.get().dropped_events(); });
}

}  // namespace pagekv::python
