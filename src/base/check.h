// PAGEKV_CHECK / PAGEKV_DCHECK: assertions for broken internal invariants.
//
// These are for our bugs only, never for user input (which gets a Status).
// PAGEKV_CHECK is always on; PAGEKV_DCHECK is on in debug and sanitizer
// builds (when NDEBUG is not defined). A failure prints the condition, the
// location and an optional message to stderr, then aborts.
#pragma once

namespace pagekv::internal {
[[noreturn]] void CheckFailed(const char* file, int line, const char* condition,
                              const char* message);
}  // namespace pagekv::internal

#define PAGEKV_CHECK_MSG(cond, msg)                                             \
  do {                                                                          \
    if (__builtin_expect(!(cond), 0)) {                                         \
      ::pagekv::internal::CheckFailed(__FILE__, __LINE__, #cond, (msg));        \
    }                                                                           \
  } while (false)

#define PAGEKV_CHECK(cond) PAGEKV_CHECK_MSG(cond, nullptr)

#ifdef NDEBUG
#define PAGEKV_DCHECK(cond) \
  do {                      \
    (void)sizeof(cond);     \
  } while (false)
#else
#define PAGEKV_DCHECK(cond) PAGEKV_CHECK(cond)
#endif
