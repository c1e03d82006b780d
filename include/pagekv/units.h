// Byte sizes as people write them: parsing "24GiB" and printing "15.25 GiB".
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "pagekv/status.h"

namespace pagekv {

// Parses a byte count. Accepted forms: plain bytes ("1048576"), binary units
// KiB, MiB, GiB, TiB (powers of 1024), decimal units KB, MB, GB, TB (powers of
// 1000), and a bare "B" suffix; units are case-insensitive; a fractional
// number is allowed with a unit ("1.5GiB") and is rounded down to whole bytes.
// Returns InvalidArgument naming the text and the accepted forms for anything
// else: empty text, a negative number, an unknown unit, or a size that does
// not fit in 63 bits.
Result<int64_t> ParseByteSize(std::string_view text);

// "16374562816" -> "15.25 GiB"; below 1 KiB prints "N B".
std::string FormatBytes(int64_t bytes);

}  // namespace pagekv
