#include "expert_cpu/common/expert_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <omp.h>

namespace maximus {
namespace expert_cpu {

namespace {

// A row is decoded kChunk columns at a time into an L1 buffer and used there by every token, so its bytes are read
// from memory once and its fp32 form never leaves L1. Each token keeps kLanes partial sums (four 16-float vectors):
// their adds are independent, which is what lets a core run at memory speed (one accumulator vector is bound by
// the add's latency), and the order of the sum is fixed, so a result does not depend on the thread count.
constexpr int64_t kChunk = 256;
constexpr int kLanes = 64;

inline float bf16_to_float(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// The codes of a quantized row are decoded group by group in planar order: for widths that pack several codes in a
// byte (4 and 2 bits), first every byte's lowest code, then every byte's next, ... (contiguous loads and stores,
// which vectorise), and x is permuted to that order once a call (planar_x). 3-bit codes straddle bytes and are
// decoded in their natural order. Either way a weight is code * scale + zero with two roundings, as the reference.
template <int BITS>
constexpr bool kPlanar = (BITS == 4 || BITS == 2);

// the group of n codes that starts at byte p, scale s and offset z, into out (planar order where kPlanar)
template <int BITS>
inline void decode_group(const uint8_t* p, int64_t n, float s, float z, float* out) {
    constexpr uint32_t mask = (1u << BITS) - 1;
    if constexpr (BITS == 8) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]) * s + z;  // -ffp-contract=off: 2 roundings
    } else if constexpr (kPlanar<BITS>) {
        constexpr int per_byte = 8 / BITS;
        const int64_t nb = n / per_byte;
        for (int j = 0; j < per_byte; ++j) {
            float* o = out + j * nb;
#pragma omp simd
            for (int64_t i = 0; i < nb; ++i)
                o[i] = static_cast<float>((static_cast<uint32_t>(p[i]) >> (j * BITS)) & mask) * s + z;
        }
    } else {  // 3 bits: 8 codes in 3 bytes, natural order
        for (int64_t i = 0; i < n; i += 8) {
            const uint8_t* q = p + i / 8 * BITS;
            uint64_t word = 0;
            for (int b = 0; b < BITS; ++b) word |= static_cast<uint64_t>(q[b]) << (8 * b);
            for (int j = 0; j < 8; ++j) out[i + j] = static_cast<float>((word >> (j * BITS)) & mask) * s + z;
        }
    }
}

// columns [c0, c0 + n) of row r (whole groups) into out
template <int BITS>
void decode_quant(const WeightView& w, int64_t r, int64_t c0, int64_t n, float* out) {
    const int64_t groups = w.cols / w.group_size;
    const uint8_t* row = static_cast<const uint8_t*>(w.data) + r * (w.cols * BITS / 8);
    for (int64_t c = c0; c < c0 + n; c += w.group_size) {
        const int64_t g = c / w.group_size;
        decode_group<BITS>(row + c * BITS / 8, w.group_size, half_to_float(w.scales[r * groups + g]),
                           half_to_float(w.zeros[r * groups + g]), out + (c - c0));
    }
}

// columns decoded at a time: kChunk, or for quantized weights whole groups (at least one)
inline int64_t chunk_of(const WeightView& w) {
    if (w.kind != WeightKind::kQuant) return kChunk;
    return w.group_size * std::max<int64_t>(1, kChunk / w.group_size);
}

// x [tokens, w.cols] in the order decode_cols gives w's columns: planar within each group (see decode_group)
std::vector<float> planar_x(const float* x, int64_t tokens, const WeightView& w) {
    std::vector<float> xp(tokens * w.cols);
    const int64_t gs = w.group_size, per_byte = 8 / w.bits, nb = gs / per_byte;
    for (int64_t t = 0; t < tokens; ++t)
        for (int64_t g0 = 0; g0 < w.cols; g0 += gs)
            for (int64_t pos = 0; pos < gs; ++pos)
                xp[t * w.cols + g0 + (pos % per_byte) * nb + pos / per_byte] = x[t * w.cols + g0 + pos];
    return xp;
}

inline bool is_planar(const WeightView& w) { return w.kind == WeightKind::kQuant && (w.bits == 4 || w.bits == 2); }

// columns [c0, c0 + n) of row r in fp32: a pointer into w for fp32 weights, else decoded into buf
inline const float* decode_cols(const WeightView& w, int64_t r, int64_t c0, int64_t n, float* buf) {
    switch (w.kind) {
        case WeightKind::kF32:
            return static_cast<const float*>(w.data) + r * w.cols + c0;
        case WeightKind::kBF16: {
            const uint16_t* p = static_cast<const uint16_t*>(w.data) + r * w.cols + c0;
#pragma omp simd
            for (int64_t k = 0; k < n; ++k) buf[k] = bf16_to_float(p[k]);
            return buf;
        }
        case WeightKind::kQuant:
            switch (w.bits) {
                case 8: decode_quant<8>(w, r, c0, n, buf); break;
                case 4: decode_quant<4>(w, r, c0, n, buf); break;
                case 3: decode_quant<3>(w, r, c0, n, buf); break;
                case 2: decode_quant<2>(w, r, c0, n, buf); break;
            }
            return buf;
    }
    return buf;
}

// acc[j] += a[k] * b[k] over k < n, lane j = k % kLanes
inline void accumulate(const float* __restrict a, const float* __restrict b, int64_t n, float* __restrict acc) {
    float l[kLanes];  // a local copy the compiler keeps in vector registers
    std::memcpy(l, acc, sizeof l);
    int64_t k = 0;
    for (; k + kLanes <= n; k += kLanes) {
#pragma omp simd
        for (int j = 0; j < kLanes; ++j) l[j] += a[k + j] * b[k + j];
    }
    for (int j = 0; k < n; ++k, ++j) l[j] += a[k] * b[k];
    std::memcpy(acc, l, sizeof l);
}

inline float lanes_sum(const float* acc) {
    float s = 0.f;
    for (int j = 0; j < kLanes; ++j) s += acc[j];
    return s;
}

// dots[t] = x_t . w[n] for every token (x in decode_cols' order; acc: tokens * kLanes floats, buf: chunk_of(w))
inline void row_dots(const float* x, int64_t tokens, const WeightView& w, int64_t n, float* acc, float* buf,
                     float* dots) {
    std::fill(acc, acc + tokens * kLanes, 0.f);
    const int64_t chunk = chunk_of(w);
    for (int64_t c0 = 0; c0 < w.cols; c0 += chunk) {
        const int64_t len = std::min(chunk, w.cols - c0);
        const float* wr = decode_cols(w, n, c0, len, buf);
        for (int64_t t = 0; t < tokens; ++t) accumulate(x + t * w.cols + c0, wr, len, acc + t * kLanes);
    }
    for (int64_t t = 0; t < tokens; ++t) dots[t] = lanes_sum(acc + t * kLanes);
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

void linear(const float* x, int64_t tokens, const WeightView& w, float* y) {
    std::vector<float> xp;
    if (is_planar(w)) x = (xp = planar_x(x, tokens, w)).data();
#pragma omp parallel
    {
        std::vector<float> acc(tokens * kLanes), buf(chunk_of(w)), dots(tokens);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < w.rows; ++n) {
            row_dots(x, tokens, w, n, acc.data(), buf.data(), dots.data());
            for (int64_t t = 0; t < tokens; ++t) y[t * w.rows + n] = dots[t];
        }
    }
}

void swiglu(const float* x, int64_t tokens, const WeightView& w1, const WeightView& w3, const WeightView& w2,
            float* h, float* y) {
    const int64_t ffn = w1.rows;
    std::vector<float> xp;  // w1 and w3 share a width and group size (checked by the bindings' caller)
    if (is_planar(w1)) x = (xp = planar_x(x, tokens, w1)).data();
#pragma omp parallel
    {
        std::vector<float> acc(tokens * kLanes), buf(chunk_of(w1)), d1(tokens), d3(tokens);
#pragma omp for schedule(static)
        for (int64_t f = 0; f < ffn; ++f) {
            row_dots(x, tokens, w1, f, acc.data(), buf.data(), d1.data());
            row_dots(x, tokens, w3, f, acc.data(), buf.data(), d3.data());
            for (int64_t t = 0; t < tokens; ++t) h[t * ffn + f] = silu(d1[t]) * d3[t];
        }
    }
    linear(h, tokens, w2, y);
}

}  // namespace expert_cpu
}  // namespace maximus
