#include "expert_cpu/common/expert_kernels.h"

#include <cmath>
#include <cstring>
#include <vector>

#include <omp.h>

namespace maximus {
namespace expert_cpu {

namespace {

constexpr int kLanes = 16;  // independent partial sums: the dot product's lanes vectorise without reassociation

inline float dot(const float* a, const float* b, int64_t n) {
    float acc[kLanes] = {0.f};
    int64_t k = 0;
    for (; k + kLanes <= n; k += kLanes) {
#pragma omp simd
        for (int j = 0; j < kLanes; ++j) acc[j] += a[k + j] * b[k + j];
    }
    for (int j = 0; k < n; ++k, ++j) acc[j] += a[k] * b[k];
    float s = 0.f;
    for (int j = 0; j < kLanes; ++j) s += acc[j];
    return s;
}

inline float bf16_to_float(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

template <int BITS>
void decode_quant_row(const WeightView& w, int64_t r, float* out) {
    constexpr uint64_t mask = (uint64_t{1} << BITS) - 1;
    const int64_t row_bytes = w.cols * BITS / 8;
    const int64_t groups = w.cols / w.group_size;
    const uint8_t* row = static_cast<const uint8_t*>(w.data) + r * row_bytes;
    for (int64_t g = 0; g < groups; ++g) {
        const float s = half_to_float(w.scales[r * groups + g]);
        const float z = half_to_float(w.zeros[r * groups + g]);
        if constexpr (8 % BITS == 0) {  // whole codes in a byte: a plain loop over the group's bytes vectorises
            constexpr int per_byte = 8 / BITS;
            const uint8_t* p = row + g * w.group_size / per_byte;
            float* o = out + g * w.group_size;
            const int64_t nb = w.group_size / per_byte;
#pragma omp simd
            for (int64_t i = 0; i < nb; ++i) {
                for (int j = 0; j < per_byte; ++j) {
                    const float q = static_cast<float>((p[i] >> (j * BITS)) & mask);
                    o[i * per_byte + j] = q * s + z;
                }
            }
            continue;
        }
        for (int64_t c = g * w.group_size; c < (g + 1) * w.group_size; c += 8) {
            const uint8_t* p = row + c / 8 * BITS;
            uint64_t word = 0;
            for (int b = 0; b < BITS; ++b) word |= static_cast<uint64_t>(p[b]) << (8 * b);
            for (int j = 0; j < 8; ++j) {
                const float q = static_cast<float>((word >> (j * BITS)) & mask);
                out[c + j] = q * s + z;  // two roundings, as the reference (built with -ffp-contract=off)
            }
        }
    }
}

inline float silu(float a) { return a / (1.f + std::exp(-a)); }

}  // namespace

float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            --exp;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

void decode_row(const WeightView& w, int64_t r, float* out) {
    switch (w.kind) {
        case WeightKind::kF32:
            std::memcpy(out, static_cast<const float*>(w.data) + r * w.cols, w.cols * sizeof(float));
            return;
        case WeightKind::kBF16: {
            const uint16_t* row = static_cast<const uint16_t*>(w.data) + r * w.cols;
#pragma omp simd
            for (int64_t k = 0; k < w.cols; ++k) out[k] = bf16_to_float(row[k]);
            return;
        }
        case WeightKind::kQuant:
            switch (w.bits) {
                case 8: return decode_quant_row<8>(w, r, out);
                case 4: return decode_quant_row<4>(w, r, out);
                case 3: return decode_quant_row<3>(w, r, out);
                case 2: return decode_quant_row<2>(w, r, out);
            }
    }
}

void linear(const float* x, int64_t tokens, const WeightView& w, float* y) {
#pragma omp parallel
    {
        std::vector<float> row(w.cols);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < w.rows; ++n) {
            decode_row(w, n, row.data());
            for (int64_t t = 0; t < tokens; ++t) y[t * w.rows + n] = dot(x + t * w.cols, row.data(), w.cols);
        }
    }
}

void swiglu(const float* x, int64_t tokens, const WeightView& w1, const WeightView& w3, const WeightView& w2,
            float* h, float* y) {
    const int64_t ffn = w1.rows, hidden = w1.cols;
#pragma omp parallel
    {
        std::vector<float> r1(hidden), r3(hidden);
#pragma omp for schedule(static)
        for (int64_t f = 0; f < ffn; ++f) {
            decode_row(w1, f, r1.data());
            decode_row(w3, f, r3.data());
            for (int64_t t = 0; t < tokens; ++t) {
                const float* xt = x + t * hidden;
                h[t * ffn + f] = silu(dot(xt, r1.data(), hidden)) * dot(xt, r3.data(), hidden);
            }
        }
    }
    linear(h, tokens, w2, y);
}

}  // namespace expert_cpu
}  // namespace maximus
