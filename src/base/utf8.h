// UTF-8 checks shared by the modules that must tell text from bytes (KV
// event extra keys, llama-server's token pieces).
#pragma once

#include <string_view>

namespace pagekv {

// True when `s` is well-formed UTF-8: no stray continuation bytes, no
// truncated sequence, no overlong form, no surrogate (U+D800-DFFF), nothing
// past U+10FFFF (RFC 3629).
bool IsValidUtf8(std::string_view s);

}  // namespace pagekv
