// KvArena: the one allocation that holds every cached K/V byte.
//
// Allocated once at start-up with mmap (page-aligned, so every slab start the
// layout computes is 64-byte aligned), transparent huge pages requested with
// madvise(MADV_HUGEPAGE) where the kernel offers them, and optionally
// pre-faulted (every page touched once) so the decode path never takes a page
// fault. Freed with munmap in the destructor.
//
// The CPU backend's arena (kernels/backend.h, CpuBackend().AllocateArena).
// Ownership: owns its memory; move-only. Thread safety: the arena itself is
// immutable after Create; concurrent access to its bytes is the caller's to
// coordinate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "pagekv/status.h"

namespace pagekv {

struct KvArenaOptions {
  int64_t size_bytes = 0;   // > 0
  bool huge_pages = true;   // madvise(MADV_HUGEPAGE); ignored where unsupported
  bool prefault = true;     // touch every page once now, not on the decode path
};

class KvArena {
 public:
  // Errors: size_bytes <= 0 (InvalidArgument); the OS refusing the mapping
  // (ResourceExhausted, naming the size and suggesting a smaller budget).
  static Result<std::unique_ptr<KvArena>> Create(const KvArenaOptions& options);

  // A device backend's arena subclasses this over its own memory.
  virtual ~KvArena();
  KvArena(const KvArena&) = delete;
  KvArena& operator=(const KvArena&) = delete;

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  int64_t size_bytes() const { return size_bytes_; }
  bool huge_pages_requested() const { return huge_pages_; }

 protected:
  // For a subclass that owns `data` (and frees it in its own destructor).
  KvArena(std::byte* data, int64_t size_bytes, bool huge_pages, bool mapped = false)
      : data_(data), size_bytes_(size_bytes), huge_pages_(huge_pages), mapped_(mapped) {}

 private:

  std::byte* data_;
  int64_t size_bytes_;
  bool huge_pages_;
  bool mapped_;  // by Create: munmap in the destructor
};

}  // namespace pagekv
