/* Runtime ISA detection (cpuid + XGETBV) and the per-tier kernel tables.
 * The detected tier is computed once when the library is loaded; the tables
 * are constant.  Nothing here needs more than baseline x86-64. */
#define _GNU_SOURCE
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "dispatch.h"

/* XCR0: which register states the OS saves (only valid when OSXSAVE is set). */
static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static int bit(unsigned v, int i) { return (int)((v >> i) & 1u); }

/* Linux hands out AMX tile data only to a process that asks (arch/x86/include/uapi/asm/prctl.h);
 * the permission covers every thread of the process. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* edx7: cpuid leaf 7 subleaf 0 EDX. */
static int amx_usable(unsigned edx7, uint64_t xcr0) {
    const int tile = bit(edx7, 24), bf16 = bit(edx7, 22);
    if (!CPUD_CAN_AMX || !tile || !bf16 || (xcr0 & (3ull << 17)) != (3ull << 17)) return 0; /* XTILECFG, XTILEDATA */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

static int detect_isa(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return CPUD_ISA_SCALAR;
    const int fma = bit(c, 12), osxsave = bit(c, 27), avx = bit(c, 28);
    if (!osxsave || !avx || !fma) return CPUD_ISA_SCALAR;
    const uint64_t xcr0 = xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return CPUD_ISA_SCALAR; /* XMM and YMM state */
    if (__get_cpuid_max(0, NULL) < 7) return CPUD_ISA_SCALAR;
    __cpuid_count(7, 0, a, b, c, d);
    const unsigned max_sub = a, edx7 = d;
    if (!bit(b, 5)) return CPUD_ISA_SCALAR; /* AVX2 */
    const int avx512 = bit(b, 16) && bit(b, 17) && bit(b, 30) && bit(b, 31); /* F DQ BW VL */
    if (!avx512 || (xcr0 & 0xe6) != 0xe6) return CPUD_ISA_AVX2; /* + opmask, ZMM state */
    if (max_sub < 1) return CPUD_ISA_AVX512;
    __cpuid_count(7, 1, a, b, c, d);
    if (!bit(a, 5)) return CPUD_ISA_AVX512;
    return amx_usable(edx7, xcr0) ? CPUD_ISA_AMX : CPUD_ISA_AVX512BF16;
}

/* bit 0: AVX-VNNI (cpuid 7.1 EAX 4), bit 1: AVX512-VNNI (cpuid 7.0 ECX 11), bit 2: AMX-INT8
 * (cpuid 7.0 EDX 25); each only where the tier it extends is usable. Read once: cpuid traps to
 * the hypervisor in a VM, tens of microseconds a call. */
static int detect_vnni(int isa) {
    unsigned a, b, c, d;
    if (isa < CPUD_ISA_AVX2) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    const int v512 = isa >= CPUD_ISA_AVX512 && bit(c, 11);
    const int amx8 = isa >= CPUD_ISA_AMX && bit(d, 25);
    int avx = 0;
    if (a >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        avx = bit(a, 4);
    }
    return avx | v512 << 1 | amx8 << 2;
}

static int g_max_isa = CPUD_ISA_SCALAR; /* set once, at load */
static int g_vnni = 0;

__attribute__((constructor)) static void cpud_dispatch_init(void) {
    g_max_isa = detect_isa();
    g_vnni = detect_vnni(g_max_isa);
}

int cpud_vnni_bits(void) { return g_vnni; }

int cpud_detect_isa(void) { return g_max_isa; }

const cpud_ops *cpud_ops_for(int isa) {
    static const cpud_ops *const table[] = {&cpud_ops_scalar, &cpud_ops_avx2, &cpud_ops_avx512,
                                            &cpud_ops_avx512bf16, &cpud_ops_amx};
    if (isa < CPUD_ISA_SCALAR || isa > g_max_isa) return NULL;
    return table[isa];
}
