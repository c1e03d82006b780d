// Whether this test binary runs under a sanitizer (ASan or TSan): slow
// model tests then check a subset (the same checks on fewer prompts, steps
// or models). GCC defines __SANITIZE_*__; clang 14 answers only
// __has_feature.
#pragma once

#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define PAGEKV_SANITIZED 1
#endif
#endif

namespace pagekv::testing {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || defined(PAGEKV_SANITIZED)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

}  // namespace pagekv::testing
