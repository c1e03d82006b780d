// pagekv.PrefixCache (prefix_cache.cc).
#pragma once

#include <nanobind/nanobind.h>

namespace pagekv::python {

void BindPrefixCache(nanobind::module_& m);

}  // namespace pagekv::python
