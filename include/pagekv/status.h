// Status and Result<T>: how every fallible PageKV call reports bad input,
// bad files and I/O failures.
//
// The three kinds of trouble and how each is reported:
//   * bad input, corrupt files, I/O failure  -> Status / Result<T> (this file);
//   * an expected outcome of normal operation (no free block, prefix miss)
//     -> a plain return value (bool, std::optional, a result struct);
//   * a broken internal invariant (our bug)  -> PAGEKV_CHECK, which aborts.
//
// A Status message names the problem and, where there is one, the fix, e.g.
//   "block_len = 100: must be a power of two in [8, 1024]".
//
// Thread safety: Status and Result are values; distinct objects may be used
// from distinct threads freely.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace pagekv {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,     // the caller passed something outside the accepted range
  kNotFound,            // a named thing (sequence, file, preset) does not exist
  kOutOfRange,          // an index or length beyond the current extent
  kFailedPrecondition,  // the object is not in a state that allows the call
  kResourceExhausted,   // the OS refused memory or another system resource
  kDataLoss,            // a file or payload is truncated or corrupt
  kIoError,             // a read, write or open failed
  kUnimplemented,       // valid request for something not built yet
  kInternal,            // an unexpected failure inside PageKV
  kUnavailable,         // busy right now (a full queue): retry later
};

// Returns a stable lower-case name, e.g. "invalid argument".
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  // The OK status carries no message.
  Status() = default;
  Status(StatusCode code, std::string message)
      : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "invalid argument: block_len = 100: must be a power of two in [8, 1024]"
  std::string ToString() const;

  // Explicitly discards a status the caller has decided not to act on.
  void IgnoreError() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

Status InvalidArgumentError(std::string message);
Status NotFoundError(std::string message);
Status OutOfRangeError(std::string message);
Status FailedPreconditionError(std::string message);
Status ResourceExhaustedError(std::string message);
Status DataLossError(std::string message);
Status IoError(std::string message);
Status UnimplementedError(std::string message);
Status InternalError(std::string message);
Status UnavailableError(std::string message);

// Result<T> holds either a value or a non-OK Status.
//
//   Result<Plan> plan = MakePlan(request);
//   if (!plan.ok()) return plan.status();
//   Use(*plan);
//
// REQUIRES: a Result is never constructed from an OK Status (that would hold
// neither a value nor an error); doing so is a bug and is turned into an
// internal error.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    if (status_.ok()) {
      status_ = Status(StatusCode::kInternal, "Result constructed from an OK status");
    }
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

  // REQUIRES: ok().
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }
  T&& operator*() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

 private:
  Status status_;  // OK exactly when value_ holds a value
  std::optional<T> value_;
};

}  // namespace pagekv

// Returns from the enclosing function when `expr` (a Status) is not OK.
#define PAGEKV_RETURN_IF_ERROR(expr)               \
  do {                                             \
    ::pagekv::Status pagekv_status_ = (expr);      \
    if (!pagekv_status_.ok()) return pagekv_status_; \
  } while (false)

#define PAGEKV_CONCAT_INNER_(a, b) a##b
#define PAGEKV_CONCAT_(a, b) PAGEKV_CONCAT_INNER_(a, b)

// `PAGEKV_ASSIGN_OR_RETURN(auto plan, MakePlan(req));` declares `plan` from
// the value of a Result, or returns its error from the enclosing function.
#define PAGEKV_ASSIGN_OR_RETURN(lhs, expr)                                  \
  auto PAGEKV_CONCAT_(pagekv_result_, __LINE__) = (expr);                   \
  if (!PAGEKV_CONCAT_(pagekv_result_, __LINE__).ok())                       \
    return std::move(PAGEKV_CONCAT_(pagekv_result_, __LINE__)).status();    \
  lhs = std::move(PAGEKV_CONCAT_(pagekv_result_, __LINE__)).value()
