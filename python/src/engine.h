// pagekv.Engine, pagekv.TokenStream and pagekv.generate (engine.cc).
#pragma once

#include <nanobind/nanobind.h>

namespace pagekv::python {

void BindEngine(nanobind::module_& m);

}  // namespace pagekv::python
