#include "kernels/amx_support.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagekv::kernels {

bool CpuAndKernelHaveAmxBf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has = [] {
    constexpr int kArchReqXcompPerm = 0x1023;  // linux/arch/x86/include/uapi/asm/prctl.h
    constexpr int kXfeatureXtiledata = 18;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    const bool amx_bf16 = (d >> 22) & 1, tile = (d >> 24) & 1;
    const bool avx512 = ((b >> 16) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1);  // F, BW, VL
    if (!amx_bf16 || !tile || !avx512) return false;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) == 0 || ((a >> 5) & 1) == 0) return false;  // AVX512-BF16
    // The kernel hands out the tile data state on request, once per process.
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has;
#else
  return false;
#endif
}

}  // namespace pagekv::kernels
