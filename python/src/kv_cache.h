// pagekv.KvCache (kv_cache.cc).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <memory>
#include <string>

#include "config.h"
#include "pagekv/kv_cache.h"

namespace pagekv::python {

// The Python object's state: the cache it owns. Views into the arena hold a
// reference to this object, so the arena outlives them.
class PyKvCache {
 public:
  PyKvCache(const GeometryArgs& geometry, bool huge_pages, bool prefault);
  ~PyKvCache();
  KvCache& cache();
  const KvCache& cache() const;

 private:
  std::unique_ptr<KvCache> cache_;
};

// One (block, layer, plane, head) slab in the arena.
struct SlabRef {
  std::byte* data = nullptr;
  nanobind::dlpack::dtype dtype;  // as NumPy sees it (bf16: uint16)
  int64_t rows = 0;               // block_len
  int64_t elems = 0;              // per row
  int64_t row_stride = 0;         // in elements
  bool bf16 = false;
};

// Validates the indices (and writability) and finds the slab.
SlabRef Slab(PyKvCache& c, int32_t block, int32_t layer, int32_t head, const std::string& plane, bool writable);
nanobind::object BlockView(PyKvCache& c, int32_t block, int32_t layer, int32_t head, const std::string& plane,
                           bool writable);
nanobind::object BlockDlpack(PyKvCache& c, int32_t block, int32_t layer, int32_t head, const std::string& plane,
                             bool writable);
void CheckInvariants(const PyKvCache& c);

void BindKvCache(nanobind::module_& m);

}  // namespace pagekv::python
