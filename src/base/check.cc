#include "base/check.h"

#include <cstdio>
#include <cstdlib>

namespace pagekv::internal {

void CheckFailed(const char* file, int line, const char* condition, const char* message) {
  std::fprintf(stderr, "PAGEKV_CHECK failed at %s:%d: %s%s%s\n", file, line, condition,
               message != nullptr ? ": " : "", message != nullptr ? message : "");
  std::fflush(stderr);
  std::abort();
}

}  // namespace pagekv::internal
