// fp32 -> bf16 copies of rows (the CPU op's compute copy, "shadow"): round to nearest even, NaN -> 0x7FC0,
// c10::BFloat16's rounding written branch-free on the bits so that the loops vectorise (through the c10
// constructor the fused pass ran slower than a separate copy_). Header-only: benchmarks/ab_stream_stores.cpp
// times the two ways against each other.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace maximus {

inline uint16_t bf16_bits(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return x != x ? uint16_t(0x7FC0) : uint16_t(rounded);
}

// Ordinary stores: each line of ``out`` is read from memory before it is written.
inline void bf16_copy_plain(uint16_t* __restrict__ out, const float* __restrict__ src, int64_t d) {
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) out[j] = bf16_bits(src[j]);
}

#if defined(__AVX2__)
// The same rounding on 8 floats, as 32-bit lanes.
inline __m256i bf16_bits8(const float* src) {
    const __m256 x = _mm256_loadu_ps(src);
    const __m256i b = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
#endif

// The copy used by the op. ``out`` is only written here (and read later by the GPU's DMA): with AVX2,
// streaming stores skip reading its lines first, 2 of the ~30 bytes an element the fused step moves
// (an unaligned head and the tail go through ordinary stores).
inline void bf16_copy(uint16_t* __restrict__ out, const float* __restrict__ src, int64_t d) {
    int64_t j = 0;
#if defined(__AVX2__)
    while (j < d && (reinterpret_cast<uintptr_t>(out + j) & 31u) != 0) {
        out[j] = bf16_bits(src[j]);
        ++j;
    }
    for (; j + 16 <= d; j += 16) {  // 16 lanes of 32 bits -> 16 x 16 bits, in order (packus works per 128 bits)
        const __m256i packed = _mm256_packus_epi32(bf16_bits8(src + j), bf16_bits8(src + j + 8));
        _mm256_stream_si256(reinterpret_cast<__m256i*>(out + j), _mm256_permute4x64_epi64(packed, 0xD8));
    }
    _mm_sfence();
#endif
    bf16_copy_plain(out + j, src + j, d - j);
}

}  // namespace maximus
