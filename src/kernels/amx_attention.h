// Paged attention through Intel AMX tiles (Sapphire Rapids and later), for
// bf16 K/V and tasks of many query rows per KV head (GQA decode with G >= 8,
// and prefill), and f16 K/V split into bf16 hi + lo tiles as it is read
// (tasks of 16 rows or more: prefill, G >= 16).
// See amx_attention.cc for the tile layout and the accuracy argument.
#pragma once

#include "kernels/attention_kernel.h"

namespace pagekv::kernels {

// Runs `task` through AMX tiles and returns true, or returns false (doing
// nothing) where the path does not apply: the CPU or kernel lacks AMX-BF16,
// a test turned it off, or the task is outside the path's shapes (K/V not
// bf16 or f16, fewer than 8 rows (16 for f16), head_dim not a multiple of 32 or above 256,
// block_len not a multiple of 16, soft-capping, a sliding window).
bool AmxAttendRows(const RowTask& task);

// Whether AmxAttendRows may run: the CPU has AMX-TILE and AMX-BF16,
// the kernel granted this process the tile state (arch_prctl), and no test
// turned the path off. SetAmxForTest returns whether the CPU and kernel allow it.
bool AmxEnabled();
bool SetAmxForTest(bool allowed);

}  // namespace pagekv::kernels
