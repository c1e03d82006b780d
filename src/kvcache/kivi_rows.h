// INT4 KIVI layers of a KvCache (internal to kvcache/): rows come and go as
// f16; inside the pool keys are stored per channel over groups of G tokens
// and values per token (layout/quantize.h). A sequence's not-yet-full group
// lives in its f16 tail (KvLayout::TailOffset) until its last token
// arrives; then the group is "sealed": quantized into its block.
//
//   positions  [ sealed groups, in blocks ........ | tail: len % G rows ]
//              0                    floor(len / G) * G                 len
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "pagekv/ids.h"
#include "pagekv/kv_layout.h"

namespace pagekv::kivi {

// Writes n tokens of one KIVI layer at positions [pos, pos + n) (REQUIRES:
// pos is where the tail stands, pos % G == the tail's fill, and the blocks
// exist). k and v: [n][heads][D] f16, tokens src_token_stride bytes apart.
void WriteRows(const KvLayout& layout, std::byte* arena, std::span<const BlockId> blocks, std::byte* tail,
               int32_t layer, int64_t pos, int64_t n, const std::byte* k, const std::byte* v, int64_t src_token_stride);

// Reads tokens [begin, begin + n) of one KIVI layer of a sequence of length
// len as f16 rows (sealed groups decoded, the rest from the tail), tokens
// dst_token_stride bytes apart.
void ReadRows(const KvLayout& layout, const std::byte* arena, std::span<const BlockId> blocks, const std::byte* tail,
              int32_t layer, int64_t len, int64_t begin, int64_t n, std::byte* k, std::byte* v,
              int64_t dst_token_stride);

// Shortening from old_len to new_len: when new_len ends inside a group that
// was sealed, its first new_len % G tokens are decoded back into the tail
// (their values carry the int4 error from then on). REQUIRES: the blocks of
// that group still held.
void RefillTail(const KvLayout& layout, const std::byte* arena, std::span<const BlockId> blocks, std::byte* tail,
                int32_t layer, int64_t old_len, int64_t new_len);

}  // namespace pagekv::kivi
