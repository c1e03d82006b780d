// The disk tier (include/pagekv/tiers.h): one preallocated file of 4 KiB
// aligned slots after a 4 KiB header, read and written whole (O_DIRECT where
// the file system allows it), and an index file rewritten atomically:
//
//   <path>        header: "PKVD" | u32 version | u64 slot_bytes | u64 num_slots |
//                 u64 block_len | u64 kv_bytes | u64 xxh3-64 of those 44 bytes,
//                 zero padded to 4 KiB;
//                 then [num_slots][slot_bytes]: a payload (block_payload.h), zero padded
//   <path>.index  "PKVI" | u32 version | u64 slot_bytes | u64 num_slots | u64 count |
//                 count x { u64 slot | u8 key size | 32 key bytes | 7 zero } (least
//                 recently used first) | u64 xxh3-64 of everything before
//
// The index may lag the data (it is rewritten every index_every_puts puts
// and on Flush); a slot it names that now holds another block fails the
// payload's key check on get and is a miss, never wrong KV.
//
// The file is the owner's alone: created 0600 with O_EXCL, opened with
// O_NOFOLLOW (a planted symbolic link is refused, its target untouched),
// reused only when it is a regular file of this user, private, and carries
// this header with the same geometry; anything else is an error that names
// the file and leaves it as it was. An exclusive flock keeps a second
// process off it while the store is open.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>

#include <xxhash.h>

#include "base/check.h"
#include "pagekv/tiers.h"
#include "tiers/block_payload.h"
#include "tiers/key_hash.h"

namespace pagekv {
namespace {

constexpr size_t kAlign = 4096;
constexpr char kIndexMagic[4] = {'P', 'K', 'V', 'I'};
constexpr uint32_t kIndexVersion = 1;
constexpr size_t kIndexHeader = 4 + 4 + 8 + 8 + 8;
constexpr size_t kIndexEntry = 48;
constexpr char kFileMagic[4] = {'P', 'K', 'V', 'D'};
constexpr uint32_t kFileVersion = 1;
constexpr size_t kFileHeaderFields = 4 + 4 + 4 * 8;  // what the header's checksum covers
constexpr off_t kDataOffset = static_cast<off_t>(kAlign);

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

struct AlignedBuffer {
  explicit AlignedBuffer(size_t n) : size(n), data(static_cast<std::byte*>(std::aligned_alloc(kAlign, n))) {}
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  std::span<std::byte> span() { return {data, size}; }
  size_t size;
  std::byte* data;
};

class DiskStore final : public BlockStore {
 public:
  DiskStore(const DiskStoreOptions& o, int fd, size_t slot_bytes, size_t slots)
      : o_(o), fd_(fd), slot_bytes_(slot_bytes), slots_(slots), buf_(slot_bytes) {}

  ~DiskStore() override {
    Flush().IgnoreError();
    ::close(fd_);
  }

  // Reads the index file; anything wrong with it leaves the store empty.
  void LoadIndex() {
    for (size_t i = slots_; i-- > 0;) free_.push_back(i);
    const std::string path = o_.path + ".index";
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return;
    std::vector<std::byte> bytes;
    std::byte chunk[65536];
    for (ssize_t n; (n = ::read(fd, chunk, sizeof chunk)) > 0;) bytes.insert(bytes.end(), chunk, chunk + n);
    ::close(fd);
    if (bytes.size() < kIndexHeader + 8) return;
    uint64_t sum, slot_bytes, slots, count;
    uint32_t version;
    std::memcpy(&sum, bytes.data() + bytes.size() - 8, 8);
    if (XXH3_64bits(bytes.data(), bytes.size() - 8) != sum || std::memcmp(bytes.data(), kIndexMagic, 4) != 0) return;
    std::memcpy(&version, bytes.data() + 4, 4);
    std::memcpy(&slot_bytes, bytes.data() + 8, 8);
    std::memcpy(&slots, bytes.data() + 16, 8);
    std::memcpy(&count, bytes.data() + 24, 8);
    if (version != kIndexVersion || slot_bytes != slot_bytes_ || slots != slots_ ||
        bytes.size() != kIndexHeader + count * kIndexEntry + 8) {
      return;
    }
    std::vector<bool> used(slots_);
    for (uint64_t i = 0; i < count; ++i) {
      const std::byte* e = bytes.data() + kIndexHeader + i * kIndexEntry;
      uint64_t slot;
      std::memcpy(&slot, e, 8);
      BlockKey key;
      key.size = static_cast<uint8_t>(e[8]);
      std::memcpy(key.bytes.data(), e + 9, 32);
      if (slot >= slots_ || used[slot] || index_.count(key) > 0) continue;
      used[slot] = true;
      lru_.push_back({slot, key});
      index_[key] = std::prev(lru_.end());
    }
    free_.clear();
    for (size_t i = slots_; i-- > 0;) {
      if (!used[i]) free_.push_back(i);
    }
  }

  Tier tier() const override { return Tier::kDisk; }

  Status Put(const BlockMeta& meta, std::span<const std::byte> kv) override {
    const size_t bytes = tiers::PayloadBytes(meta.tokens.size(), kv.size());
    if (bytes > slot_bytes_) {
      return InvalidArgumentError("disk tier: a block of " + std::to_string(kv.size()) +
                                  " KV bytes does not fit its slots of " + std::to_string(slot_bytes_));
    }
    std::lock_guard lock(mu_);
    size_t slot;
    bool replaced = false;
    if (auto it = index_.find(meta.key); it != index_.end()) {
      slot = it->second->slot;
      lru_.erase(it->second);
      index_.erase(it);
      replaced = true;
    } else if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else {
      slot = lru_.front().slot;
      Removed(lru_.front().key);
      index_.erase(lru_.front().key);
      lru_.pop_front();
      ++stats_.evictions;
    }
    std::memset(buf_.data + bytes, 0, slot_bytes_ - bytes);
    tiers::EncodePayloadInto(meta, kv, seal_, buf_.span().first(bytes));
    const ssize_t n = ::pwrite(fd_, buf_.data, slot_bytes_, kDataOffset + static_cast<off_t>(slot * slot_bytes_));
    if (n != static_cast<ssize_t>(slot_bytes_)) {
      const std::string why = n < 0 ? Errno("disk tier: write to " + o_.path) : "disk tier: short write to " + o_.path;
      free_.push_back(slot);
      ++stats_.errors;
      if (replaced) Removed(meta.key);  // its old copy in that slot is no longer trusted
      return n < 0 && errno == ENOSPC ? ResourceExhaustedError(why) : UnavailableError(why);
    }
    lru_.push_back({slot, meta.key});
    index_[meta.key] = std::prev(lru_.end());
    ++stats_.puts;
    if (!replaced && o_.on_change) o_.on_change(TierChange{TierChange::Kind::kStored, Tier::kDisk, meta});
    if (++puts_since_index_ >= o_.index_every_puts) WriteIndex().IgnoreError();
    return Status::Ok();
  }

  Result<bool> Get(const BlockMeta& meta, std::span<std::byte> kv) override {
    std::lock_guard lock(mu_);
    ++stats_.gets;
    auto it = index_.find(meta.key);
    if (it == index_.end()) {
      ++stats_.misses;
      return false;
    }
    const size_t slot = it->second->slot;
    const ssize_t n = ::pread(fd_, buf_.data, slot_bytes_, kDataOffset + static_cast<off_t>(slot * slot_bytes_));
    if (n < 0) {
      ++stats_.errors;
      return UnavailableError(Errno("disk tier: read from " + o_.path));
    }
    if (const Status d = tiers::DecodePayload(buf_.span().first(static_cast<size_t>(n)), meta, kv, seal_); !d.ok()) {
      ++stats_.corrupt;  // truncated file, flipped bits, or a slot the index no longer describes
      if (tiers::IsNotAuthentic(d)) ++stats_.unauthenticated;  // or a block written by someone without the key
      ++stats_.misses;
      Removed(meta.key);
      lru_.erase(it->second);
      index_.erase(it);
      free_.push_back(slot);
      return false;
    }
    lru_.splice(lru_.end(), lru_, it->second);
    ++stats_.hits;
    return true;
  }

  // Every slot is free or held, once; the index and the LRU agree.
  void CheckInvariants() const override {
    std::lock_guard lock(mu_);
    std::vector<int> seen(slots_, 0);
    for (size_t s : free_) {
      PAGEKV_CHECK_MSG(s < slots_ && seen[s]++ == 0, "disk tier: a free slot is out of range or listed twice");
    }
    PAGEKV_CHECK_MSG(lru_.size() == index_.size(), "disk tier: the LRU and the index differ in size");
    PAGEKV_CHECK_MSG(free_.size() + index_.size() == slots_, "disk tier: free + held slots != slots");
    for (const auto& [key, at] : index_) {
      PAGEKV_CHECK_MSG(at->key == key, "disk tier: an index entry's LRU node holds another key");
      PAGEKV_CHECK_MSG(at->slot < slots_ && seen[at->slot]++ == 0, "disk tier: a slot is both free and held, or held twice");
    }
  }

  Result<bool> Contains(const BlockKey& key) override {
    std::lock_guard lock(mu_);
    return index_.count(key) > 0;
  }

  Status Remove(const BlockKey& key) override {
    std::lock_guard lock(mu_);
    if (auto it = index_.find(key); it != index_.end()) {
      free_.push_back(it->second->slot);
      Removed(key);
      lru_.erase(it->second);
      index_.erase(it);
    }
    return Status::Ok();
  }

  int64_t capacity_bytes() const override { return static_cast<int64_t>(slots_ * slot_bytes_); }

  TierStats Stats() const override {
    std::lock_guard lock(mu_);
    TierStats s = stats_;
    s.name = "disk";
    s.blocks_now = static_cast<int64_t>(index_.size());
    s.bytes_now = s.blocks_now * static_cast<int64_t>(slot_bytes_);
    s.capacity_bytes = capacity_bytes();
    return s;
  }

  Status Flush() override {
    std::lock_guard lock(mu_);
    return WriteIndex();
  }

 private:
  struct Entry {
    size_t slot;
    BlockKey key;
  };

  // REQUIRES: mu_ held.
  void Removed(const BlockKey& key) {
    if (!o_.on_change) return;
    TierChange c{TierChange::Kind::kRemoved, Tier::kDisk, {}};
    c.meta.key = key;
    o_.on_change(c);
  }

  // REQUIRES: mu_ held.
  Status WriteIndex() {
    puts_since_index_ = 0;
    if (::fdatasync(fd_) != 0) return UnavailableError(Errno("disk tier: sync " + o_.path));
    std::vector<std::byte> out(kIndexHeader + lru_.size() * kIndexEntry + 8);
    std::memcpy(out.data(), kIndexMagic, 4);
    const uint64_t header[] = {slot_bytes_, slots_, lru_.size()};
    std::memcpy(out.data() + 4, &kIndexVersion, 4);
    std::memcpy(out.data() + 8, header, sizeof header);
    size_t at = kIndexHeader;
    for (const Entry& e : lru_) {
      const uint64_t slot = e.slot;
      std::memcpy(out.data() + at, &slot, 8);
      out[at + 8] = static_cast<std::byte>(e.key.size);
      std::memcpy(out.data() + at + 9, e.key.bytes.data(), 32);
      at += kIndexEntry;
    }
    const uint64_t sum = XXH3_64bits(out.data(), at);
    std::memcpy(out.data() + at, &sum, 8);
    const std::string tmp = o_.path + ".index.tmp", path = o_.path + ".index";
    ::unlink(tmp.c_str());  // a stale one, or something planted: never written through
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return UnavailableError(Errno("disk tier: create " + tmp));
    const bool ok = ::write(fd, out.data(), out.size()) == static_cast<ssize_t>(out.size()) && ::fsync(fd) == 0;
    ::close(fd);
    if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
      const Status s = UnavailableError(Errno("disk tier: write " + path));
      ::unlink(tmp.c_str());
      return s;
    }
    return Status::Ok();
  }

  const DiskStoreOptions o_;
  const tiers::PayloadSeal seal_{o_.payload_key};
  const int fd_;
  const size_t slot_bytes_, slots_;
  mutable std::mutex mu_;
  AlignedBuffer buf_;
  std::vector<size_t> free_;
  std::list<Entry> lru_;  // least recently used first
  std::unordered_map<BlockKey, std::list<Entry>::iterator, tiers::KeyHash> index_;
  int64_t puts_since_index_ = 0;
  TierStats stats_;
};

}  // namespace

// The 4 KiB file header for this geometry.
void FileHeader(std::span<std::byte> out, uint64_t slot_bytes, uint64_t slots, uint64_t block_len, uint64_t kv_bytes) {
  std::memset(out.data(), 0, out.size());
  std::memcpy(out.data(), kFileMagic, 4);
  std::memcpy(out.data() + 4, &kFileVersion, 4);
  const uint64_t fields[] = {slot_bytes, slots, block_len, kv_bytes};
  std::memcpy(out.data() + 8, fields, sizeof fields);
  const uint64_t sum = XXH3_64bits(out.data(), kFileHeaderFields);
  std::memcpy(out.data() + kFileHeaderFields, &sum, 8);
}

// Why an existing file may not be used as this store, or "" when it may.
std::string RefuseExisting(int fd, const struct stat& st, const std::string& path, uint64_t slot_bytes,
                           uint64_t slots, uint64_t block_len, uint64_t kv_bytes) {
  const std::string fix = "; give --disk-cache a new path (or delete the file if it is yours)";
  if (!S_ISREG(st.st_mode)) return "disk tier: " + path + " is not a regular file" + fix;
  if (st.st_uid != ::geteuid()) return "disk tier: " + path + " belongs to another user" + fix;
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return "disk tier: " + path + " is open to other users (mode " + mode + "); chmod 600 it, or" +
           fix.substr(1);
  }
  if (st.st_size == 0) return "";  // empty (e.g. made by mktemp): nothing to overwrite
  AlignedBuffer have(kAlign), want(kAlign);
  if (st.st_size < static_cast<off_t>(kAlign) || ::pread(fd, have.data, kAlign, 0) != static_cast<ssize_t>(kAlign) ||
      std::memcmp(have.data, kFileMagic, 4) != 0) {
    return "disk tier: " + path + " is not a PageKV disk cache (no PKVD header); refusing to overwrite it" + fix;
  }
  FileHeader(want.span(), slot_bytes, slots, block_len, kv_bytes);
  if (std::memcmp(have.data, want.data, kFileHeaderFields + 8) != 0) {
    uint64_t f[4];
    std::memcpy(f, have.data + 8, sizeof f);
    return "disk tier: " + path + " is a disk cache of another shape (" + std::to_string(f[1]) + " slots of " +
           std::to_string(f[0]) + " bytes for blocks of " + std::to_string(f[2]) + " tokens / " + std::to_string(f[3]) +
           " KV bytes; this cache needs " + std::to_string(slots) + " of " + std::to_string(slot_bytes) + " for " +
           std::to_string(block_len) + " / " + std::to_string(kv_bytes) +
           "); give the same model, cache type and --disk-cache-size, or" + fix.substr(1);
  }
  return "";
}

Result<std::unique_ptr<BlockStore>> CreateDiskStore(const DiskStoreOptions& o) {
  if (o.path.empty()) return InvalidArgumentError("disk tier: no path given (--disk-cache PATH)");
  if (o.block_len < 1 || o.kv_bytes < 1) return InvalidArgumentError("disk tier: block_len and kv_bytes must be positive");
  const size_t payload = tiers::PayloadBytes(static_cast<size_t>(o.block_len), static_cast<size_t>(o.kv_bytes));
  const size_t slot = (payload + kAlign - 1) / kAlign * kAlign;
  if (o.capacity_bytes < static_cast<int64_t>(slot)) {
    return InvalidArgumentError("disk tier: " + std::to_string(o.capacity_bytes) + " bytes hold no block; one takes " +
                                std::to_string(slot) + " (raise --disk-cache-size)");
  }
  const size_t slots = static_cast<size_t>(o.capacity_bytes) / slot;
  const auto size = kDataOffset + static_cast<off_t>(slots * slot);
  // Existing: opened as it is, never through a link. Missing: created here
  // and nowhere else (O_EXCL), private from the start.
  int fd = -1;
  bool created = false;
  for (const int direct : {o.direct_io ? O_DIRECT : 0, 0}) {
    fd = ::open(o.path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | direct);
    if (fd < 0 && errno == ENOENT) {
      fd = ::open(o.path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW | direct, 0600);
      created = fd >= 0;
    }
    if (fd >= 0 || errno != EINVAL || direct == 0) break;  // EINVAL: no O_DIRECT here (tmpfs)
  }
  if (fd < 0 && errno == ELOOP) {
    return FailedPreconditionError("disk tier: " + o.path +
                                   " is a symbolic link; give the real path (a link would send the cache's writes "
                                   "to whatever it names)");
  }
  if (fd < 0) return UnavailableError(Errno("disk tier: cannot open " + o.path));
  auto fail = [&](Status s) {
    if (created) ::unlink(o.path.c_str());
    ::close(fd);
    return s;
  };
  struct stat st {};
  if (::fstat(fd, &st) != 0) return fail(UnavailableError(Errno("disk tier: cannot stat " + o.path)));
  if (!created) {
    if (std::string why = RefuseExisting(fd, st, o.path, slot, slots, static_cast<uint64_t>(o.block_len),
                                         static_cast<uint64_t>(o.kv_bytes));
        !why.empty()) {
      return fail(FailedPreconditionError(why));
    }
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    return fail(errno == EWOULDBLOCK
                    ? FailedPreconditionError("disk tier: " + o.path +
                                              " is in use by another process (or another store in this one); give "
                                              "each process its own --disk-cache, or share blocks through --redis")
                    : UnavailableError(Errno("disk tier: cannot lock " + o.path)));
  }
  if (created || st.st_size == 0) {
    ::unlink((o.path + ".index").c_str());  // another file's index, if any
    AlignedBuffer header(kAlign);
    FileHeader(header.span(), slot, slots, static_cast<uint64_t>(o.block_len), static_cast<uint64_t>(o.kv_bytes));
    if (::pwrite(fd, header.data, kAlign, 0) != static_cast<ssize_t>(kAlign)) {
      return fail(UnavailableError(Errno("disk tier: cannot write the header of " + o.path)));
    }
  }
  if (st.st_size < size) {
    // New, or this cache's own file cut short: its missing slots read as
    // zeros, which fail the payload check (a miss).
    if (const int err = ::posix_fallocate(fd, 0, size); err != 0) {
      return fail(err == ENOSPC ? ResourceExhaustedError("disk tier: no space for " + std::to_string(size) +
                                                         " bytes at " + o.path +
                                                         " (lower --disk-cache-size or free space)")
                                : UnavailableError("disk tier: cannot preallocate " + o.path + ": " + std::strerror(err)));
    }
  }
  auto store = std::make_unique<DiskStore>(o, fd, slot, slots);
  store->LoadIndex();
  return std::unique_ptr<BlockStore>(std::move(store));
}

}  // namespace pagekv
