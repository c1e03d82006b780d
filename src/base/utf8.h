// UTF-8 checks and encoding shared by the modules that must tell text from
// bytes (KV event extra keys, llama-server's token pieces) or write it (the
// tokenizer's byte map, the chat templates' escapes).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace pagekv {

// True when `s` is well-formed UTF-8: no stray continuation bytes, no
// truncated sequence, no overlong form, no surrogate (U+D800-DFFF), nothing
// past U+10FFFF (RFC 3629).
bool IsValidUtf8(std::string_view s);

// Appends the UTF-8 encoding of code point cp (<= U+10FFFF; the caller
// rules out surrogates where they matter).
void AppendUtf8(uint32_t cp, std::string& out);

}  // namespace pagekv
