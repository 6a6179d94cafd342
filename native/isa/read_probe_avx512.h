/* The read probe's loop on 64-byte vectors, shared by the GEMM headers of the avx512,
 * avx512bf16 and amx tiers. */
#ifndef CPUD_READ_PROBE_AVX512_H
#define CPUD_READ_PROBE_AVX512_H

/* [b, e): 4 KiB aligned range -> xor of its 64-bit words (forces every load) */
static TGT uint64_t probe_range(const char *b, const char *e) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (const char *p = b; p < e; p += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_load_si512((const void *)p));
        a1 = _mm512_xor_si512(a1, _mm512_load_si512((const void *)(p + 64)));
        a2 = _mm512_xor_si512(a2, _mm512_load_si512((const void *)(p + 128)));
        a3 = _mm512_xor_si512(a3, _mm512_load_si512((const void *)(p + 192)));
    }
    a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    uint64_t lanes[8];
    _mm512_storeu_si512((void *)lanes, a0);
    uint64_t s = 0;
    for (size_t i = 0; i < sizeof lanes / sizeof lanes[0]; i++) s ^= lanes[i];
    return s;
}

#endif
