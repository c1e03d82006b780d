// pagekv.BlockMeta, BlockStore (HostStore / DiskStore / RedisStore) and
// Tiers (tiers.cc).
#pragma once

#include <nanobind/nanobind.h>

#include "pagekv/kv_cache.h"
#include "pagekv/prefix_cache.h"

namespace pagekv::python {

void BindTiers(nanobind::module_& m);

// The LowerTiers of a pagekv.Tiers object (raises TypeError for another
// object, InvalidArgumentError for tiers made for another block shape).
LowerTiers* TiersOf(nanobind::handle tiers, const KvCache& cache);

}  // namespace pagekv::python
