// The SHA-256 of a file's bytes as lowercase hex (tests that check a
// generated file is byte for byte the one their goldens came from).
#pragma once

#include <string>

namespace pagekv::testing {

// Empty when the file cannot be read.
std::string FileSha256Hex(const std::string& path);

}  // namespace pagekv::testing
