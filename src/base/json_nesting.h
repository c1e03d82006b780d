// How deep a JSON text nests, read off its bytes before any parser sees it.
// nlohmann::json parses iteratively, but copying, dumping and converting a
// parsed value (the chat template's values) recurse once per level: a 1 MB
// body of '[' is 500,000 levels and overflows any thread's stack. Every
// place that parses JSON from outside the process (request bodies, messages
// and tools handed to the library, trace lines, a fleet's replies) checks
// this first and refuses what nests deeper than kMaxJsonNesting.
#pragma once

#include <cstddef>
#include <string_view>

#include "pagekv/status.h"

namespace pagekv {

// Deeper than any real request: OpenAI tool schemas nest 10-20 levels.
inline constexpr size_t kMaxJsonNesting = 128;

// The deepest nesting of arrays and objects in `text`, brackets inside
// strings (and escaped quotes) not counted. Malformed text gets a figure
// too (the parser reports what is wrong with it); the scan stops once it
// passes `stop_after`.
size_t JsonNesting(std::string_view text, size_t stop_after = kMaxJsonNesting);

// Ok, or InvalidArgument naming `what`, the depth and the limit.
Status CheckJsonNesting(std::string_view text, std::string_view what, size_t max_depth = kMaxJsonNesting);

}  // namespace pagekv
