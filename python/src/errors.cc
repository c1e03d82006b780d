#include "errors.h"

#include <Python.h>

#include <array>
#include <string_view>

namespace nb = nanobind;

namespace pagekv::python {
namespace {

struct ErrorClass {
  StatusCode code;
  const char* name;
  PyObject* builtin;  // the second base (null: Error only)
  const char* doc;
};

// Filled by RegisterErrors; indexed by StatusCode.
std::array<PyObject*, 16> classes{};
PyObject* base_error = nullptr;

}  // namespace

void RegisterErrors(nb::module_& m) {
  base_error = PyErr_NewExceptionWithDoc("pagekv.Error", "Every error PageKV raises.", PyExc_Exception, nullptr);
  m.attr("Error") = nb::borrow(base_error);
  const ErrorClass table[] = {
      {StatusCode::kInvalidArgument, "InvalidArgumentError", PyExc_ValueError,
       "An argument outside the accepted range (also a ValueError)."},
      {StatusCode::kNotFound, "NotFoundError", PyExc_LookupError,
       "A named thing (sequence, file, preset) does not exist (also a LookupError)."},
      {StatusCode::kOutOfRange, "OutOfRangeError", PyExc_IndexError,
       "An index or length beyond the current extent (also an IndexError)."},
      {StatusCode::kFailedPrecondition, "FailedPreconditionError", PyExc_RuntimeError,
       "The object is not in a state that allows the call (also a RuntimeError)."},
      {StatusCode::kResourceExhausted, "ResourceExhaustedError", PyExc_MemoryError,
       "The OS refused memory or another resource (also a MemoryError)."},
      {StatusCode::kDataLoss, "DataLossError", nullptr, "A file or payload is truncated or corrupt."},
      {StatusCode::kIoError, "IoError", PyExc_OSError, "A read, write or open failed (also an OSError)."},
      {StatusCode::kUnimplemented, "UnimplementedError", PyExc_NotImplementedError,
       "A valid request for something not built yet (also a NotImplementedError)."},
      {StatusCode::kInternal, "InternalError", PyExc_RuntimeError,
       "An unexpected failure inside PageKV (also a RuntimeError)."},
      {StatusCode::kUnavailable, "UnavailableError", nullptr, "Busy right now (a full queue): retry later."},
  };
  for (const ErrorClass& e : table) {
    PyObject* bases = e.builtin != nullptr ? PyTuple_Pack(2, base_error, e.builtin) : PyTuple_Pack(1, base_error);
    const std::string qualified = std::string("pagekv.") + e.name;
    PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), e.doc, bases, nullptr);
    Py_DECREF(bases);
    if (cls == nullptr) throw nb::python_error();
    classes[static_cast<size_t>(e.code)] = cls;  // kept for the module's lifetime
    m.attr(e.name) = nb::borrow(cls);
  }
}

void Raise(const Status& st) {
  PyObject* cls = classes[static_cast<size_t>(st.code())];
  PyErr_SetString(cls != nullptr ? cls : base_error, st.message().c_str());
  throw nb::python_error();
}

void RaiseInvalid(const std::string& message) { Raise(Status(StatusCode::kInvalidArgument, message)); }

}  // namespace pagekv::python
