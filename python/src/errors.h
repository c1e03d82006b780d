// The Python side of pagekv::Status: an exception hierarchy under
// pagekv.Error, each class also deriving from the built-in exception a
// Python user expects for that meaning (InvalidArgumentError is a
// ValueError, ResourceExhaustedError a MemoryError, ...), so `except
// ValueError` and `except pagekv.Error` both work.
#pragma once

#include <nanobind/nanobind.h>

#include <string>

#include "pagekv/status.h"

namespace pagekv::python {

// Creates the classes in module m (once, at import).
void RegisterErrors(nanobind::module_& m);

// Raises the class of st.code() with st.message() (throws
// nanobind::python_error). REQUIRES: !st.ok().
[[noreturn]] void Raise(const Status& st);

// Raises when st is an error.
inline void Check(const Status& st) {
  if (!st.ok()) Raise(st);
}

// The value, or raises the error.
template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(r).value();
}

// Raises pagekv.InvalidArgumentError (a ValueError) with `message`.
[[noreturn]] void RaiseInvalid(const std::string& message);

}  // namespace pagekv::python
