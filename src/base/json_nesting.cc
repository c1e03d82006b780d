// JsonNesting (json_nesting.h).
#include "base/json_nesting.h"

#include <string>

namespace pagekv {

size_t JsonNesting(std::string_view text, size_t stop_after) {
  size_t depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"': in_string = true; break;
      case '[':
      case '{':
        if (++depth > deepest) {
          deepest = depth;
          if (deepest > stop_after) return deepest;
        }
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        break;
      default: break;
    }
  }
  return deepest;
}

Status CheckJsonNesting(std::string_view text, std::string_view what, size_t max_depth) {
  if (JsonNesting(text, max_depth) <= max_depth) return Status::Ok();
  return InvalidArgumentError(std::string(what) + " nests arrays and objects more than " + std::to_string(max_depth) +
                              " levels deep: flatten it (at most " + std::to_string(max_depth) + " levels are read)");
}

}  // namespace pagekv
