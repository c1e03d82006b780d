// What the Intel AMX paths (amx_attention.cc, amx_matmul.cc) share: whether
// this CPU and kernel let the process use AMX-BF16 tiles, and the tile
// configuration's memory layout.
#pragma once

#include <cstdint>

namespace pagekv::kernels {

// The CPU has AMX-TILE, AMX-BF16, AVX-512 F / BW / VL and AVX512-BF16, and
// the kernel granted this process the tile data state (arch_prctl
// ARCH_REQ_XCOMP_PERM, asked once per process). false off x86-64.
bool CpuAndKernelHaveAmxBf16();

// The 64-byte operand of LDTILECFG (palette 1): rows and bytes per row of
// each of the eight tile registers.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

}  // namespace pagekv::kernels
