// The GIL around calls into the library that may wait (engine steps and
// locks, tier I/O, model loading).
#pragma once

#include <nanobind/nanobind.h>

namespace pagekv::python {

// f() with the GIL released (it must not touch Python objects).
template <typename F>
auto Released(F&& f) {
  nanobind::gil_scoped_release release;
  return f();
}

}  // namespace pagekv::python
