#include "kernels/kv_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "pagekv/units.h"

namespace pagekv {

Result<std::unique_ptr<KvArena>> KvArena::Create(const KvArenaOptions& options) {
  if (options.size_bytes <= 0) {
    return InvalidArgumentError("arena size_bytes = " + std::to_string(options.size_bytes) +
                                ": must be positive");
  }
  void* p = mmap(nullptr, static_cast<size_t>(options.size_bytes), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    return ResourceExhaustedError("could not map a KV arena of " +
                                  FormatBytes(options.size_bytes) + " (" + std::strerror(err) +
                                  "): lower num_blocks or the byte budget");
  }
  bool huge = false;
#ifdef MADV_HUGEPAGE
  if (options.huge_pages) huge = madvise(p, static_cast<size_t>(options.size_bytes), MADV_HUGEPAGE) == 0;
#endif
  auto* bytes = static_cast<std::byte*>(p);
  if (options.prefault) {
    const int64_t page = sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : 4096;
    // Writing one byte per page faults it in now; mmap memory is already zero.
    for (int64_t off = 0; off < options.size_bytes; off += page) {
      *reinterpret_cast<volatile std::byte*>(bytes + off) = std::byte{0};
    }
  }
  return std::unique_ptr<KvArena>(new KvArena(bytes, options.size_bytes, huge, /*mapped=*/true));
}

KvArena::~KvArena() {
  if (mapped_) munmap(data_, static_cast<size_t>(size_bytes_));
}

}  // namespace pagekv
