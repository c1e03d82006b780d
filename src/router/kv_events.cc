// KV events on the router's side (kv_events.h): the msgpack decoder and the
// content-keyed global index.
#include "router/kv_events.h"

#include <msgpack.hpp>

#include <cstring>

namespace pagekv::router {
namespace {

Status Bad(const std::string& what) { return InvalidArgumentError("kv event batch: " + what); }

std::string_view Str(const msgpack::object& o) { return {o.via.str.ptr, o.via.str.size}; }

// A block hash: a u64 (8 bytes big-endian), or bytes.
Result<std::string> Hash(const msgpack::object& o) {
  if (o.type == msgpack::type::POSITIVE_INTEGER) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>(o.via.u64 >> (56 - 8 * i));
    return s;
  }
  if (o.type == msgpack::type::NEGATIVE_INTEGER) {
    std::string s(8, '\0');
    const auto v = static_cast<uint64_t>(o.via.i64);
    for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>(v >> (56 - 8 * i));
    return s;
  }
  if (o.type == msgpack::type::BIN) return std::string(o.via.bin.ptr, o.via.bin.size);
  if (o.type == msgpack::type::STR) return std::string(Str(o));
  return Bad("a block hash is neither an integer nor bytes");
}

Result<int64_t> Int(const msgpack::object& o, const char* field) {
  if (o.type == msgpack::type::POSITIVE_INTEGER && o.via.u64 <= static_cast<uint64_t>(INT64_MAX)) {
    return static_cast<int64_t>(o.via.u64);
  }
  if (o.type == msgpack::type::NEGATIVE_INTEGER) return o.via.i64;
  return Bad(std::string("'") + field + "' is not an integer");
}

Result<DecodedEvent> Event(const msgpack::object& o) {
  if (o.type != msgpack::type::MAP) return Bad("an event is not a map");
  DecodedEvent e;
  std::string type;
  for (uint32_t i = 0; i < o.via.map.size; ++i) {
    const msgpack::object& k = o.via.map.ptr[i].key;
    const msgpack::object& v = o.via.map.ptr[i].val;
    if (k.type != msgpack::type::STR) return Bad("an event's field name is not a string");
    const std::string_view name = Str(k);
    if (name == "type") {
      if (v.type != msgpack::type::STR) return Bad("'type' is not a string");
      type = Str(v);
    } else if (name == "block_hashes") {
      if (v.type != msgpack::type::ARRAY) return Bad("'block_hashes' is not an array");
      for (uint32_t j = 0; j < v.via.array.size; ++j) {
        PAGEKV_ASSIGN_OR_RETURN(std::string h, Hash(v.via.array.ptr[j]));
        e.hashes.push_back(std::move(h));
      }
    } else if (name == "parent_block_hash") {
      if (v.type != msgpack::type::NIL) {
        PAGEKV_ASSIGN_OR_RETURN(std::string h, Hash(v));
        e.parent = std::move(h);
      }
    } else if (name == "token_ids") {
      if (v.type != msgpack::type::ARRAY) return Bad("'token_ids' is not an array");
      for (uint32_t j = 0; j < v.via.array.size; ++j) {
        PAGEKV_ASSIGN_OR_RETURN(int64_t t, Int(v.via.array.ptr[j], "token_ids"));
        if (t < INT32_MIN || t > INT32_MAX) return Bad("a token id is out of range");
        e.token_ids.push_back(static_cast<int32_t>(t));
      }
    } else if (name == "block_size") {
      PAGEKV_ASSIGN_OR_RETURN(int64_t b, Int(v, "block_size"));
      if (b < 1 || b > (1 << 20)) return Bad("'block_size' is out of range");
      e.block_size = static_cast<int32_t>(b);
    } else if (name == "lora_id") {
      if (v.type != msgpack::type::NIL) {
        PAGEKV_ASSIGN_OR_RETURN(e.lora_id, Int(v, "lora_id"));
      }
    } else if (name == "medium") {
      if (v.type == msgpack::type::STR) e.medium = Str(v);
    } else if (name == "extra_keys") {
      if (v.type == msgpack::type::NIL) continue;
      if (v.type != msgpack::type::ARRAY) return Bad("'extra_keys' is not an array");
      for (uint32_t j = 0; j < v.via.array.size; ++j) {
        const msgpack::object& per = v.via.array.ptr[j];
        std::vector<std::string> keys;
        if (per.type == msgpack::type::ARRAY) {
          for (uint32_t m = 0; m < per.via.array.size; ++m) {
            if (per.via.array.ptr[m].type == msgpack::type::STR) keys.emplace_back(Str(per.via.array.ptr[m]));
          }
        } else if (per.type != msgpack::type::NIL) {
          return Bad("a block's extra keys are not an array");
        }
        e.extra_keys.push_back(std::move(keys));
      }
    } else if (name == "group_idx") {
      PAGEKV_ASSIGN_OR_RETURN(int64_t g, Int(v, "group_idx"));
      if (g < 0 || g > (1 << 20)) return Bad("'group_idx' is out of range");
      e.group = static_cast<int32_t>(g);
    } else if (name == "kv_cache_spec_kind") {
      e.sliding = v.type == msgpack::type::STR && Str(v) == "sliding_window";
    }
    // Anything else (lora_name, a window size, later fields) is not needed.
  }
  if (type == "BlockStored") {
    e.type = DecodedEvent::Type::kStored;
    if (e.block_size == 0) return Bad("BlockStored without 'block_size'");
    if (e.token_ids.size() != e.hashes.size() * static_cast<size_t>(e.block_size)) {
      return Bad("BlockStored has " + std::to_string(e.token_ids.size()) + " token ids for " +
                 std::to_string(e.hashes.size()) + " blocks of " + std::to_string(e.block_size));
    }
  } else if (type == "BlockRemoved") {
    e.type = DecodedEvent::Type::kRemoved;
  } else if (type == "AllBlocksCleared") {
    e.type = DecodedEvent::Type::kCleared;
  } else {
    return Bad("unknown event type '" + type + "'");
  }
  return e;
}

int BitIndex(uint8_t bit) {
  for (int i = 0; i < 5; ++i) {
    if (bit == (1 << i)) return i;
  }
  return 4;
}

}  // namespace

Result<DecodedBatch> DecodeKvEventBatch(std::string_view payload) {
  msgpack::object_handle oh;
  try {
    // Bounded by the payload itself: an element takes at least a byte, so
    // no honest batch declares more than that; without the limits a flipped
    // byte declaring 2^32 entries would be allocated before it is read.
    const size_t n = payload.size();
    const msgpack::unpack_limit limit(n, n / 2 + 1, n, n, n, 16);
    oh = msgpack::unpack(payload.data(), payload.size(), nullptr, nullptr, limit);
  } catch (const std::exception& ex) {
    return Bad(std::string("not msgpack: ") + ex.what());
  }
  const msgpack::object& root = oh.get();
  if (root.type != msgpack::type::ARRAY || root.via.array.size < 2) {
    return Bad("not an array of [timestamp, events, rank]");
  }
  DecodedBatch b;
  const msgpack::object& ts = root.via.array.ptr[0];
  if (ts.type == msgpack::type::FLOAT64 || ts.type == msgpack::type::FLOAT32) b.timestamp = ts.via.f64;
  const msgpack::object& events = root.via.array.ptr[1];
  if (events.type != msgpack::type::ARRAY) return Bad("the events are not an array");
  for (uint32_t i = 0; i < events.via.array.size; ++i) {
    PAGEKV_ASSIGN_OR_RETURN(DecodedEvent e, Event(events.via.array.ptr[i]));
    b.events.push_back(std::move(e));
  }
  if (root.via.array.size >= 3 && root.via.array.ptr[2].type == msgpack::type::POSITIVE_INTEGER) {
    b.data_parallel_rank = static_cast<int32_t>(std::min<uint64_t>(root.via.array.ptr[2].via.u64, INT32_MAX));
  }
  return b;
}

uint8_t MediumOf(std::string_view medium) {
  if (medium == "GPU") return kGpu;
  if (medium == "CPU") return kCpu;
  if (medium == "DISK") return kDisk;
  if (medium == "REDIS") return kRedis;
  return kOtherMedium;
}

size_t KvIndex::KeyHasher::operator()(const BlockKey& k) const {
  uint64_t h;
  std::memcpy(&h, k.bytes.data(), 8);
  return static_cast<size_t>(h);
}

uint8_t KvIndex::Held::media() const {
  uint8_t m = 0;
  for (int i = 0; i < 5; ++i) m |= copies[static_cast<size_t>(i)] > 0 ? static_cast<uint8_t>(1 << i) : 0;
  return m;
}

KvIndex::Backend& KvIndex::Of(int backend) {
  if (static_cast<size_t>(backend) >= backends_.size()) backends_.resize(static_cast<size_t>(backend) + 1);
  return backends_[static_cast<size_t>(backend)];
}

void KvIndex::Apply(int backend, const DecodedBatch& batch) {
  Backend& b = Of(backend);
  for (const DecodedEvent& e : batch.events) {
    if (e.sliding) continue;  // a hybrid backend's sliding group: its full group's blocks say it all
    switch (e.type) {
      case DecodedEvent::Type::kStored: Store(b, e); break;
      case DecodedEvent::Type::kRemoved: Remove(b, e); break;
      case DecodedEvent::Type::kCleared: ClearPool(b); break;
    }
  }
}

void KvIndex::Store(Backend& b, const DecodedEvent& e) {
  if (e.block_size != block_len_) {
    ++stats_.other_block_size;
    return;
  }
  std::optional<BlockKey> parent;
  if (e.parent) {
    auto it = b.by_hash.find(*e.parent);
    if (it == b.by_hash.end()) {
      ++stats_.unknown_parent;
      return;
    }
    parent = it->second;
  }
  const uint8_t medium = MediumOf(e.medium);
  for (size_t i = 0; i < e.hashes.size(); ++i) {
    ExtraKeys extra;
    extra.adapter_id = e.lora_id;
    if (!parent && i < e.extra_keys.size()) {
      for (const std::string& k : e.extra_keys[i]) {
        if (k.rfind("salt:", 0) == 0) extra.cache_salt = k.substr(5);
      }
    }
    const auto tokens = std::span<const int32_t>(e.token_ids).subspan(i * static_cast<size_t>(block_len_),
                                                                      static_cast<size_t>(block_len_));
    const BlockKey key = Sha256BlockKey(parent ? &*parent : nullptr, tokens, extra);
    Held& h = b.held[key];
    if (h.media() == 0) ++stats_.blocks;
    ++h.copies[static_cast<size_t>(BitIndex(medium))];
    b.by_hash[e.hashes[i]] = key;
    ++stats_.stored;
    parent = key;
  }
}

void KvIndex::Remove(Backend& b, const DecodedEvent& e) {
  const int bit = BitIndex(MediumOf(e.medium));
  for (const std::string& hash : e.hashes) {
    auto it = b.by_hash.find(hash);
    if (it == b.by_hash.end()) {
      ++stats_.unknown_removals;
      continue;
    }
    auto h = b.held.find(it->second);
    if (h == b.held.end() || h->second.copies[static_cast<size_t>(bit)] == 0) {
      ++stats_.unknown_removals;
      continue;
    }
    --h->second.copies[static_cast<size_t>(bit)];
    ++stats_.removed;
    if (h->second.media() == 0) {
      b.held.erase(h);
      b.by_hash.erase(it);
      --stats_.blocks;
    }
  }
}

void KvIndex::ClearPool(Backend& b) {
  for (auto it = b.held.begin(); it != b.held.end();) {
    it->second.copies[0] = 0;
    if (it->second.media() == 0) {
      --stats_.blocks;
      it = b.held.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = b.by_hash.begin(); it != b.by_hash.end();) {
    it = b.held.count(it->second) == 0 ? b.by_hash.erase(it) : std::next(it);
  }
}

void KvIndex::Forget(int backend) {
  if (static_cast<size_t>(backend) >= backends_.size()) return;
  Backend& b = backends_[static_cast<size_t>(backend)];
  stats_.blocks -= static_cast<int64_t>(b.held.size());
  b = Backend{};
}

std::vector<KvIndex::Hit> KvIndex::Match(std::span<const int32_t> tokens, const std::optional<std::string>& salt,
                                         int64_t adapter, int num_backends) const {
  std::vector<Hit> hits(static_cast<size_t>(num_backends));
  const int64_t n = tokens.empty() ? 0 : (static_cast<int64_t>(tokens.size()) - 1) / block_len_;
  std::vector<bool> going(static_cast<size_t>(num_backends), true), pool_going = going;
  std::optional<BlockKey> parent;
  for (int64_t i = 0; i < n; ++i) {
    ExtraKeys extra;
    extra.adapter_id = adapter;
    if (i == 0) extra.cache_salt = salt;
    const BlockKey key = Sha256BlockKey(parent ? &*parent : nullptr,
                                        tokens.subspan(static_cast<size_t>(i * block_len_), static_cast<size_t>(block_len_)),
                                        extra);
    bool any = false;
    for (int k = 0; k < num_backends; ++k) {
      if (!going[static_cast<size_t>(k)]) continue;
      uint8_t media = 0;
      if (static_cast<size_t>(k) < backends_.size()) {
        const auto& held = backends_[static_cast<size_t>(k)].held;
        if (auto it = held.find(key); it != held.end()) media = it->second.media();
      }
      if (media == 0) {
        going[static_cast<size_t>(k)] = false;
        continue;
      }
      ++hits[static_cast<size_t>(k)].blocks;
      if (pool_going[static_cast<size_t>(k)] && (media & kGpu) != 0) {
        ++hits[static_cast<size_t>(k)].pool_blocks;
      } else {
        pool_going[static_cast<size_t>(k)] = false;
      }
      any = true;
    }
    if (!any) break;
    parent = key;
  }
  return hits;
}

KvIndexStats KvIndex::Stats() const { return stats_; }

int64_t KvIndex::BackendBlocks(int backend) const {
  return static_cast<size_t>(backend) < backends_.size() ? static_cast<int64_t>(backends_[static_cast<size_t>(backend)].held.size()) : 0;
}

}  // namespace pagekv::router
