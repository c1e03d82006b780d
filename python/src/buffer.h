// Bytes from Python without a copy: any object with the buffer protocol.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <span>
#include <string>

#include "errors.h"

namespace pagekv::python {

// A read-only contiguous view of any Python object with the buffer protocol
// (bytes, bytearray, memoryview, a C-contiguous NumPy array), held for the
// life of this object.
class Buffer {
 public:
  Buffer(nanobind::handle obj, const char* what) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_SIMPLE) != 0) {
      PyErr_Clear();
      RaiseInvalid(std::string(what) + ": a bytes-like object is needed (bytes, bytearray, memoryview or a "
                                       "C-contiguous NumPy array), got " +
                   std::string(nanobind::type_name(obj.type()).c_str()));
    }
  }
  ~Buffer() { PyBuffer_Release(&view_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  std::span<const std::byte> bytes() const {
    return {static_cast<const std::byte*>(view_.buf), static_cast<size_t>(view_.len)};
  }

 private:
  Py_buffer view_{};
};

}  // namespace pagekv::python
