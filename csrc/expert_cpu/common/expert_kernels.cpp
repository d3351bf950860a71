#include "expert_cpu/common/expert_kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include <immintrin.h>
#include <omp.h>

namespace maximus {
namespace expert_cpu {

namespace {

std::atomic<bool> g_dynamic_rows{true};

// The threads a call runs on: the OpenMP team size less one thread per 8 (14 of 16). A call's team waits for its
// slowest thread; with every core in the team, any other runnable host thread (a CUDA wait spinning on its core,
// the driver's own threads) shares a core with one of ours and the call lasts a scheduler time slice, many times
// its own work. The free cores keep that from happening (scripts/gpu/probe_host_table.py, docs/bench/moe_offload.md).
inline int team_size() {
    const int n = omp_get_max_threads();
    return std::max(1, n - n / 8);
}

// Sets the calling thread's run-time schedule, which the `omp for schedule(runtime)` loops over a weight's `blocks`
// row blocks below inherit (see set_dynamic_rows); returns the team size the call's parallel region takes.
inline int row_schedule(int64_t blocks) {
    const int team = team_size();
    if (g_dynamic_rows.load(std::memory_order_relaxed)) {
        const int64_t chunk = std::max<int64_t>(1, blocks / (8 * static_cast<int64_t>(team)));
        omp_set_schedule(omp_sched_dynamic, static_cast<int>(chunk));
    } else {
        omp_set_schedule(omp_sched_static, 0);
    }
    return team;
}

// The fp32 path (fp32 weights, and every weight on a host without AVX512-BF16; the bf16 path is further down).
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

// ---------------------------------------------------------------------------------------------------------------
// AVX512-BF16 path. vdpbf16ps multiplies bf16 pairs and adds them to fp32 lanes; a product of two bf16 values is
// exact in fp32, so only the fp32 sums round. Weights are bf16 already, and quantized codes (integers < 256) are
// exact in bf16: a byte lookup decodes them (decode32), or for 4- and 2-bit codes at few tokens a shift and a
// bit-select (WordCodes). x is split once a call into x = hi + lo (both bf16, hi = rne(x), lo = rne(x - hi)): one dot product
// per weight vector when x is exactly bf16 (lo == 0 everywhere, as in a bf16 model's decode), two otherwise, which
// keeps ~16 of fp32 x's mantissa bits. A quantized row is, group by group, scale_g * dot(codes_g, x_g) + zero_g *
// sum(x_g), the group sums of x taken once a call. Each output is one row's sums in a fixed order, done by one
// thread, so the result does not depend on the thread count. Rows go in sub-blocks of 4 (bf16) or 2 (quantized) and
// tokens in blocks of 4 (then one of the 3, 2 or 1 left): each weight vector is decoded once and used by every token
// of the block, and each x vector by every row of it, from registers. (Column chunks with the accumulators in L1 between
// them, to keep x in L1 at many tokens, measured slower.)
// ---------------------------------------------------------------------------------------------------------------

#define MAXIMUS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi")))

constexpr int kVec = 32;           // bf16 lanes of a vector: the x rows are padded to a multiple of it
constexpr int64_t kPrefetch = 1024;  // bytes ahead of the weight stream a thread asks for

// whether the host runs the bf16 path: its ISA, unless MAXIMUS_EXPERT_CPU_FP32=1 asks for the fp32 path (to test
// or compare the fallback on a host that has the ISA); read once a process
bool bf16_isa() {
    static const bool ok = [] {
        const char* force = std::getenv("MAXIMUS_EXPERT_CPU_FP32");
        if (force && std::strcmp(force, "1") == 0) return false;
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
    }();
    return ok;
}

inline uint16_t float_to_bf16_rne(float f) {  // x is finite here; a nan keeps its sign and stays a nan
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// x [tokens, cols] as bf16 hi and lo rows of ld (cols padded with zeros), and for quantized weights the sum of
// x over each group (fp32, in order)
struct SplitX {
    std::vector<uint16_t> hi, lo;
    std::vector<float> group_sum;  // [tokens, groups]
    int64_t ld = 0, groups = 0;
    bool exact = true;  // lo == 0: x is exactly bf16
    // word layout (word_codes(w)): hi and lo permuted block by block to the order the words' codes are decoded in,
    // and run_sum [tokens, wblocks * 16]: base * the sum of hi + lo over each fp32 lane's codes
    bool words = false;
    int64_t wblocks = 0;
    std::vector<float> run_sum;
    std::vector<float> base_group_sum;  // [tokens, groups]: base * the sum of hi + lo over each group
};

// 4- and 2-bit rows decoded a 16-bit word at a time, without a lookup: shifted so that code j lands in the top BITS
// bits of a bf16 mantissa and OR-ed with the exponent of base = 2^BITS, a code becomes the bf16 value base + code,
// exactly (a shift and a vpternlog for 32 codes). A 64-byte load is 32 words of K codes; vector j of a block holds
// code j of every word, so x is permuted to that order once a call. After vdpbf16ps, fp32 lane l of a block holds
// words 2l and 2l + 1, i.e. 2K consecutive codes, all in one group when group_size % 2K == 0: subtracting base * the
// lane's sum of x leaves the lane's dot(codes, x) (exact where that dot is: a one-hot x reads the reference's bits),
// which the lane's group scale then multiplies.
template <int BITS>
struct WordCodes {
    static constexpr int K = 16 / BITS;   // codes a word
    static constexpr int kBlock = 32 * K;  // codes a 64-byte load
    static constexpr uint16_t kMask = ((1u << BITS) - 1) << (7 - BITS);
    static constexpr uint16_t kBase = BITS == 4 ? 0x4180 : 0x4080;  // bf16 16.0 and 4.0
    static constexpr int shift(int j) { return (7 - BITS) - j * BITS; }  // > 0: left
};

// Whether a call takes the word layout: 4- and 2-bit weights whose groups hold whole lanes and either fill whole
// blocks or tile a block (a block's lane scales are then one in-register permute of its first groups' scales).
inline bool word_codes(const WeightView& w) {
    if (w.kind != WeightKind::kQuant || (w.bits != 4 && w.bits != 2)) return false;
    const int64_t gs = w.group_size, block = 512 / w.bits, lane = 32 / w.bits;
    return gs % lane == 0 && (gs % block == 0 || block % gs == 0);
}

// where column k of a row goes in the word layout: block b, word i, code j -> b * block + j * 32 + i
inline int64_t word_pos(int64_t k, int64_t block, int64_t per_word) {
    const int64_t r = k % block;
    return k - r + (r % per_word) * 32 + r / per_word;
}

SplitX split_x(const float* x, int64_t tokens, const WeightView& w) {
    SplitX s;
    s.words = bf16_isa() && word_codes(w);
    const int64_t block = s.words ? 512 / w.bits : 0, per_word = s.words ? 16 / w.bits : 0;
    if (s.words) {
        s.wblocks = (w.cols + block - 1) / block;
        s.ld = s.wblocks * block;  // whole blocks, zeros past the row
    } else {
        // a group's last vector may start less than kVec before the row's end: one vector of zeros past it, so its
        // loads stay in the row (0 * anything finite, where the masked-off codes and weights read as 0)
        s.ld = (w.cols + kVec - 1) / kVec * kVec + kVec;
    }
    s.hi.assign(tokens * s.ld, 0);
    s.lo.assign(tokens * s.ld, 0);
    const int64_t n = tokens * w.cols;
    int inexact = 0;
#pragma omp parallel for schedule(static) reduction(| : inexact) if (n > 16384)
    for (int64_t i = 0; i < n; ++i) {  // element by element: the same split at any thread count
        const int64_t t = i / w.cols, k = i % w.cols;
        const float v = x[i];
        const uint16_t h = float_to_bf16_rne(v);
        const uint16_t l = float_to_bf16_rne(v - bf16_to_float(h));
        const int64_t pos = s.words ? word_pos(k, block, per_word) : k;
        s.hi[t * s.ld + pos] = h;
        s.lo[t * s.ld + pos] = l;
        inexact |= (l & 0x7fff) != 0;
    }
    s.exact = !inexact;
    if (s.words) {
        const float base = static_cast<float>(1 << w.bits);
        const int64_t lanes = s.wblocks * 16, run = 2 * per_word;
        s.run_sum.assign(tokens * lanes, 0.f);
#pragma omp parallel for collapse(2) schedule(static) if (n > 16384)
        for (int64_t t = 0; t < tokens; ++t)
            for (int64_t l = 0; l < lanes; ++l) {
                float sum = 0.f;  // what the dot products saw: hi + lo, in column order
                for (int64_t k = l * run; k < std::min((l + 1) * run, w.cols); ++k) {
                    const int64_t pos = t * s.ld + word_pos(k, block, per_word);
                    sum += bf16_to_float(s.hi[pos]) + bf16_to_float(s.lo[pos]);
                }
                s.run_sum[t * lanes + l] = base * sum;
            }
        // for the 4-token blocks (dots_words' kFold): a group's lanes in order (consecutive, 2K codes each)
        const int64_t groups = w.cols / w.group_size, per_group = w.group_size / run;
        s.base_group_sum.assign(tokens * groups, 0.f);
        for (int64_t t = 0; t < (tokens / 4) * 4; ++t)
            for (int64_t g = 0; g < groups; ++g) {
                float sum = 0.f;
                for (int64_t l = g * per_group; l < (g + 1) * per_group; ++l) sum += s.run_sum[t * lanes + l];
                s.base_group_sum[t * groups + g] = sum;
            }
    }
    if (w.kind == WeightKind::kQuant) {
        s.groups = w.cols / w.group_size;
        s.group_sum.assign(tokens * s.groups, 0.f);
#pragma omp parallel for collapse(2) schedule(static) if (n > 16384)
        for (int64_t t = 0; t < tokens; ++t)
            for (int64_t g = 0; g < s.groups; ++g) {
                float sum = 0.f;
                for (int64_t k = g * w.group_size; k < (g + 1) * w.group_size; ++k) sum += x[t * w.cols + k];
                s.group_sum[t * s.groups + g] = sum;
            }
    }
    return s;
}

MAXIMUS_BF16_TARGET inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

MAXIMUS_BF16_TARGET inline __m512bh load_bh(const uint16_t* p) { return as_bh(_mm512_loadu_si512(p)); }

// One vector of columns [k, k + 32) of R weight rows (wv, already in registers) against T tokens of x: each x vector
// loaded once serves the R rows. x's lo half (LO) goes to a chain of its own, lo, for one token (half the latency);
// with more tokens the token chains are independent and the lo products join acc, which keeps the registers for them.
template <int R, int T, bool LO>
MAXIMUS_BF16_TARGET inline void dot_tokens(__m512 (&acc)[R][T], __m512 (&lo)[R][T], const __m512bh (&wv)[R],
                                           const SplitX& x, int64_t t0, int64_t k) {
    constexpr bool kLoChain = LO && T == 1;
    for (int t = 0; t < T; ++t) {
        const __m512bh xh = load_bh(x.hi.data() + (t0 + t) * x.ld + k);
        for (int i = 0; i < R; ++i) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], wv[i], xh);
        if constexpr (LO) {
            const __m512bh xl = load_bh(x.lo.data() + (t0 + t) * x.ld + k);
            for (int i = 0; i < R; ++i) {
                if constexpr (kLoChain) lo[i][t] = _mm512_dpbf16_ps(lo[i][t], wv[i], xl);
                else acc[i][t] = _mm512_dpbf16_ps(acc[i][t], wv[i], xl);
            }
        }
    }
}

// out[i * ld + j] = w[r0 + i] . x[t0 + j] for i < R, j < T, bf16 rows: each x vector loaded serves R rows and
// each weight vector T tokens (from registers); one accumulator per row and token, its adds in a fixed order
template <int R, int T, bool LO>
MAXIMUS_BF16_TARGET void dots_bf16(const WeightView& w, int64_t r0, const SplitX& x, int64_t t0, float* out,
                                   int64_t ld) {
    const uint16_t* row[R];
    for (int i = 0; i < R; ++i) row[i] = static_cast<const uint16_t*>(w.data) + (r0 + i) * w.cols;
    constexpr bool kLoChain = LO && T == 1;  // see dot_tokens
    __m512 acc[R][T], lo[R][T];
    for (int i = 0; i < R; ++i)
        for (int t = 0; t < T; ++t) acc[i][t] = lo[i][t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < w.cols; k += kVec) {
        const int64_t n = std::min<int64_t>(kVec, w.cols - k);
        const __mmask32 m = n == kVec ? ~0u : (1u << n) - 1;  // the tail: masked loads read zeros past the row
        __m512bh wv[R];
        for (int i = 0; i < R; ++i) {
            _mm_prefetch(reinterpret_cast<const char*>(row[i] + k) + kPrefetch, _MM_HINT_T0);
            wv[i] = as_bh(_mm512_maskz_loadu_epi16(m, row[i] + k));
        }
        dot_tokens<R, T, LO>(acc, lo, wv, x, t0, k);
    }
    for (int i = 0; i < R; ++i)
        for (int t = 0; t < T; ++t)
            out[i * ld + t] = _mm512_reduce_add_ps(kLoChain ? _mm512_add_ps(acc[i][t], lo[i][t]) : acc[i][t]);
}

// How 32 codes of BITS < 8 become bf16: vpermb puts bytes b and b + 1 (b the byte of the code's first bit) in each
// 16-bit lane, vpsrlvw shifts the code down, and vpermw looks it up in a table of the bf16 value of every 5-bit
// index, periodic in 2^BITS (vpermw reads an index's low 5 bits, so the bits above the code need no mask).
template <int BITS>
struct CodeLayout {
    alignas(64) uint8_t bytes[64];
    alignas(64) uint16_t shifts[32];
    alignas(64) uint16_t table[32];
    CodeLayout() {
        for (int j = 0; j < 32; ++j) {
            bytes[2 * j] = static_cast<uint8_t>(j * BITS / 8);
            bytes[2 * j + 1] = static_cast<uint8_t>(j * BITS / 8 + 1);
            shifts[j] = static_cast<uint16_t>(j * BITS % 8);
            table[j] = float_to_bf16_rne(static_cast<float>(j % (1 << BITS)));
        }
    }
};

// n <= 32 codes (n a multiple of 8) starting at byte p, as bf16 (zeros past n), in natural order
template <int BITS>
MAXIMUS_BF16_TARGET inline __m512bh decode32(const uint8_t* p, int64_t n, __m512i bytes, __m512i shifts,
                                              __m512i table) {
    const int64_t nbytes = n * BITS / 8;
    if constexpr (BITS == 8) {
        const __mmask32 m = nbytes == 32 ? ~0u : (1u << nbytes) - 1;
        const __m256i b = _mm256_maskz_loadu_epi8(m, p);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(b)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(b, 1)));
        return _mm512_cvtne2ps_pbh(hi, lo);
    } else {
        const __mmask16 m = static_cast<__mmask16>((1u << nbytes) - 1);
        const __m512i b = _mm512_zextsi128_si512(_mm_maskz_loadu_epi8(m, p));
        const __m512i v = _mm512_srlv_epi16(_mm512_permutexvar_epi8(bytes, b), shifts);
        return as_bh(_mm512_permutexvar_epi16(v, table));
    }
}

// Per row of a quantized block: its group scales as fp32 into scale_buf (a row's groups, zeros past them), and for
// each of T tokens the zero term sum_g zero_g * sum(x_g) into zsum; FOLD (the word decode from 4 tokens) also takes
// scale_g * base_group_sum_g from it (see dots_words)
template <int T, bool FOLD = false>
MAXIMUS_BF16_TARGET inline void scales_and_zero_terms(const WeightView& w, int64_t r, const SplitX& x, int64_t t0,
                                                      float* scale_buf, float (&zsum)[T]) {
    const int64_t groups = x.groups;
    const uint16_t* sc = w.scales + r * groups;
    const uint16_t* zr = w.zeros + r * groups;
    __m512 zacc[T];
    for (int t = 0; t < T; ++t) zacc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 16) {
        const int64_t n = std::min<int64_t>(16, groups - g);
        const __mmask16 m = n == 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
        const __m512 z = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, zr + g));
        const __m512 sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, sc + g));
        _mm512_storeu_ps(scale_buf + g, sv);
        for (int t = 0; t < T; ++t) {
            zacc[t] = _mm512_fmadd_ps(z, _mm512_maskz_loadu_ps(m, x.group_sum.data() + (t0 + t) * groups + g),
                                      zacc[t]);
            if constexpr (FOLD)
                zacc[t] = _mm512_fnmadd_ps(
                    sv, _mm512_maskz_loadu_ps(m, x.base_group_sum.data() + (t0 + t) * groups + g), zacc[t]);
        }
    }
    for (int t = 0; t < T; ++t) zsum[t] = _mm512_reduce_add_ps(zacc[t]);
}

// out[i * ld + j] = dequant(w)[r0 + i] . x[t0 + j] for i < R, j < T: per group scale * dot(codes, x) + zero *
// sum(x) (the zero term over all groups first, then the scaled group dots), in a fixed order
template <int BITS, int R, int T, bool LO>
MAXIMUS_BF16_TARGET void dots_quant(const WeightView& w, int64_t r0, const SplitX& x, int64_t t0, float* scale_buf,
                                    float* out, int64_t ld) {
    constexpr bool kLoChain = LO && T == 1;
    static const CodeLayout<BITS> lay;
    const __m512i bytes = _mm512_load_si512(lay.bytes), shifts = _mm512_load_si512(lay.shifts),
                  table = _mm512_load_si512(lay.table);
    const int64_t gs = w.group_size, groups = x.groups, sld = groups + 16;
    const uint8_t* row[R];
    float zsum[R][T];
    for (int i = 0; i < R; ++i) {
        row[i] = static_cast<const uint8_t*>(w.data) + (r0 + i) * (w.cols * BITS / 8);
        scales_and_zero_terms<T>(w, r0 + i, x, t0, scale_buf + i * sld, zsum[i]);
    }
    __m512 acc[R][T];
    for (int i = 0; i < R; ++i)
        for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512 d[R][T], dl[R][T];  // x's lo half in a chain of its own for one token, as in dots_bf16
        for (int i = 0; i < R; ++i)
            for (int t = 0; t < T; ++t) d[i][t] = dl[i][t] = _mm512_setzero_ps();
        for (int64_t k = 0; k < gs; k += kVec) {
            const int64_t n = std::min<int64_t>(kVec, gs - k), c = g * gs + k;
            __m512bh wv[R];
            for (int i = 0; i < R; ++i) {
                const uint8_t* p = row[i] + c * BITS / 8;
                _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch, _MM_HINT_T0);
                wv[i] = decode32<BITS>(p, n, bytes, shifts, table);
            }
            dot_tokens<R, T, LO>(d, dl, wv, x, t0, c);
        }
        for (int i = 0; i < R; ++i) {
            const __m512 s = _mm512_set1_ps(scale_buf[i * sld + g]);
            for (int t = 0; t < T; ++t)
                acc[i][t] = _mm512_fmadd_ps(kLoChain ? _mm512_add_ps(d[i][t], dl[i][t]) : d[i][t], s, acc[i][t]);
        }
    }
    for (int i = 0; i < R; ++i)
        for (int t = 0; t < T; ++t) out[i * ld + t] = _mm512_reduce_add_ps(acc[i][t]) + zsum[i][t];
}

template <int S>
MAXIMUS_BF16_TARGET inline __m512i shift_words(__m512i v) {
    if constexpr (S > 0) return _mm512_slli_epi16(v, S);
    else if constexpr (S < 0) return _mm512_srli_epi16(v, -S);
    else return v;
}

// code J of each of a row's 32 words (wv) as bf16 base + code, its products with T tokens of x added to d
template <int BITS, int J, int R, int T, bool LO>
MAXIMUS_BF16_TARGET inline void word_codes_dot(__m512 (&d)[R][T], const __m512i (&wv)[R], __m512i mask, __m512i base,
                                               const uint16_t* xh, const uint16_t* xl, int64_t xld) {
    __m512bh c[R];
    for (int i = 0; i < R; ++i)  // (word & mask) | base: vpternlog truth table 0xEA
        c[i] = as_bh(_mm512_ternarylogic_epi32(shift_words<WordCodes<BITS>::shift(J)>(wv[i]), mask, base, 0xEA));
    for (int t = 0; t < T; ++t) {
        const __m512bh h = load_bh(xh + t * xld + J * 32);
        for (int i = 0; i < R; ++i) d[i][t] = _mm512_dpbf16_ps(d[i][t], c[i], h);
        if constexpr (LO) {
            const __m512bh l = load_bh(xl + t * xld + J * 32);
            for (int i = 0; i < R; ++i) d[i][t] = _mm512_dpbf16_ps(d[i][t], c[i], l);
        }
    }
}

template <int BITS, int R, int T, bool LO, int... J>
MAXIMUS_BF16_TARGET inline void word_block(std::integer_sequence<int, J...>, __m512 (&d)[R][T],
                                           const __m512i (&wv)[R], __m512i mask, __m512i base,
                                           const uint16_t* xh, const uint16_t* xl, int64_t xld) {
    (word_codes_dot<BITS, J, R, T, LO>(d, wv, mask, base, xh, xl, xld), ...);
}

// dots_quant for 4- and 2-bit rows in the word layout (WordCodes): per 64-byte block, d = dot(base + codes, x) lane
// by lane, minus base * the lane's x sum (below 4 tokens; from 4 see kFold), times the lane's group scale, into acc;
// the zero term as in dots_quant
template <int BITS, int R, int T, bool LO>
MAXIMUS_BF16_TARGET void dots_words(const WeightView& w, int64_t r0, const SplitX& x, int64_t t0, float* scale_buf,
                                    float* out, int64_t ld) {
    using WC = WordCodes<BITS>;
    // From 4 tokens the base * sum(x) is taken back once a row and token, over the groups with the zero term
    // (sum over groups of scale * base * the group's x sum), not lane by lane in every block: one multiply-add per
    // 16 groups instead of a subtract per block and token, which the 4-token blocks are bound by. The lane-by-lane
    // form keeps a one-hot x's result bit-exact (the lane's dot is the code itself); the folded form rounds
    // scale * (base + code) and takes scale * base back, within an ulp or two of it.
    constexpr bool kFold = T >= 4;
    const int64_t gs = w.group_size, groups = x.groups, nblk = x.wblocks, lanes = nblk * 16, sld = groups + 16;
    const int64_t row_bytes = w.cols * BITS / 8;
    const __m512i mask = _mm512_set1_epi16(static_cast<short>(WC::kMask)),
                  base = _mm512_set1_epi16(static_cast<short>(WC::kBase));
    // a block's lanes, when it holds several groups: lane l is in the block's group (l * 2K) / gs
    const bool tiled = gs < WC::kBlock;
    alignas(64) int32_t lane_group[16];
    for (int l = 0; l < 16; ++l) lane_group[l] = static_cast<int32_t>(tiled ? l * 2 * WC::K / gs : 0);
    const __m512i lane_idx = _mm512_load_si512(lane_group);
    const uint8_t* row[R];
    float zsum[R][T];
    for (int i = 0; i < R; ++i) {
        row[i] = static_cast<const uint8_t*>(w.data) + (r0 + i) * row_bytes;
        scales_and_zero_terms<T, kFold>(w, r0 + i, x, t0, scale_buf + i * sld, zsum[i]);
    }
    __m512 acc[R][T];
    for (int i = 0; i < R; ++i)
        for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
    const uint16_t* xh = x.hi.data() + t0 * x.ld;
    const uint16_t* xl = x.lo.data() + t0 * x.ld;
    const float* rsum = x.run_sum.data() + t0 * lanes;
    const int64_t blocks_a_group = gs < WC::kBlock ? 1 : gs / WC::kBlock, groups_a_block = WC::kBlock / gs;
    int64_t g0 = 0, in_group = 0;  // the block's first group (groups start at block starts), blocks into it
    for (int64_t b = 0; b < nblk; ++b) {
        const int64_t off = b * 64, left = row_bytes - off;
        const __mmask64 m = left >= 64 ? ~0ull : (1ull << left) - 1;  // the tail: zero words past the row
        __m512i wv[R];
        for (int i = 0; i < R; ++i) {
            _mm_prefetch(reinterpret_cast<const char*>(row[i] + off) + kPrefetch, _MM_HINT_T0);
            wv[i] = _mm512_maskz_loadu_epi8(m, row[i] + off);
        }
        __m512 d[R][T];
        for (int i = 0; i < R; ++i)
            for (int t = 0; t < T; ++t) d[i][t] = _mm512_setzero_ps();
        word_block<BITS, R, T, LO>(std::make_integer_sequence<int, WC::K>{}, d, wv, mask, base, xh + b * WC::kBlock,
                                   xl + b * WC::kBlock, x.ld);
        if constexpr (!kFold)
            for (int t = 0; t < T; ++t) {
                const __m512 rs = _mm512_loadu_ps(rsum + t * lanes + b * 16);
                for (int i = 0; i < R; ++i) d[i][t] = _mm512_sub_ps(d[i][t], rs);
            }
        for (int i = 0; i < R; ++i) {  // lane l's scale: group g0 + lane_idx[l] (all g0 when a group fills blocks)
            const __m512 s = _mm512_permutexvar_ps(lane_idx, _mm512_loadu_ps(scale_buf + i * sld + g0));
            for (int t = 0; t < T; ++t) acc[i][t] = _mm512_fmadd_ps(d[i][t], s, acc[i][t]);
        }
        if (++in_group == blocks_a_group) g0 += groups_a_block == 0 ? 1 : groups_a_block, in_group = 0;
    }
    for (int i = 0; i < R; ++i)
        for (int t = 0; t < T; ++t) out[i * ld + t] = _mm512_reduce_add_ps(acc[i][t]) + zsum[i][t];
}

// rows a block: a loaded x vector serves this many rows (bf16 rows need no decode, so more of them fit the registers)
inline int rows_per_block(const WeightView& w) { return w.kind == WeightKind::kBF16 ? 4 : 2; }

template <int R, int T, bool LO>
MAXIMUS_BF16_TARGET void dots_block(const WeightView& w, int64_t r0, const SplitX& x, int64_t t0, float* scale_buf,
                                    float* out, int64_t ld) {
    if (w.kind == WeightKind::kBF16) return dots_bf16<R, T, LO>(w, r0, x, t0, out, ld);
    if (x.words)
        return w.bits == 4 ? dots_words<4, R, T, LO>(w, r0, x, t0, scale_buf, out, ld)
                           : dots_words<2, R, T, LO>(w, r0, x, t0, scale_buf, out, ld);
    switch (w.bits) {
        case 8: return dots_quant<8, R, T, LO>(w, r0, x, t0, scale_buf, out, ld);
        case 4: return dots_quant<4, R, T, LO>(w, r0, x, t0, scale_buf, out, ld);
        case 3: return dots_quant<3, R, T, LO>(w, r0, x, t0, scale_buf, out, ld);
        case 2: return dots_quant<2, R, T, LO>(w, r0, x, t0, scale_buf, out, ld);
    }
}

// dots[i * tokens + t] = w[r0 + i] . x[t] for i < R and every token, in token blocks of 4, then 3, 2 or 1: the
// accumulators stay in the 32 vector registers
template <int R, bool LO>
MAXIMUS_BF16_TARGET void rows_dots_t(const WeightView& w, int64_t r0, const SplitX& x, int64_t tokens,
                                     float* scale_buf, float* dots) {
    int64_t t = 0;
    for (; t + 4 <= tokens; t += 4) dots_block<R, 4, LO>(w, r0, x, t, scale_buf, dots + t, tokens);
    if (tokens - t == 3) dots_block<R, 3, LO>(w, r0, x, t, scale_buf, dots + t, tokens);
    else if (tokens - t == 2) dots_block<R, 2, LO>(w, r0, x, t, scale_buf, dots + t, tokens);
    else if (tokens - t == 1) dots_block<R, 1, LO>(w, r0, x, t, scale_buf, dots + t, tokens);
}

// dots for rows [r0, r0 + n), n <= rows_per_block(w); a row's sums are the same in a block of any size
MAXIMUS_BF16_TARGET void rows_dots(const WeightView& w, int64_t r0, int64_t n, const SplitX& x, int64_t tokens,
                                   float* scale_buf, float* dots) {
    for (int64_t i = 0; i < n;) {
        const int64_t left = n - i;
        float* out = dots + i * tokens;
        if (left >= 4 && rows_per_block(w) >= 4) {
            x.exact ? rows_dots_t<4, false>(w, r0 + i, x, tokens, scale_buf, out)
                    : rows_dots_t<4, true>(w, r0 + i, x, tokens, scale_buf, out);
            i += 4;
        } else if (left >= 2) {
            x.exact ? rows_dots_t<2, false>(w, r0 + i, x, tokens, scale_buf, out)
                    : rows_dots_t<2, true>(w, r0 + i, x, tokens, scale_buf, out);
            i += 2;
        } else {
            x.exact ? rows_dots_t<1, false>(w, r0 + i, x, tokens, scale_buf, out)
                    : rows_dots_t<1, true>(w, r0 + i, x, tokens, scale_buf, out);
            i += 1;
        }
    }
}

// the weights the bf16 path takes: bf16, and quantized codes of any width (fp32 weights keep the fp32 path)
inline bool bf16_path(const WeightView& w) { return w.kind != WeightKind::kF32 && bf16_isa(); }

inline int64_t scale_buf_len(const WeightView& w) {
    return w.kind == WeightKind::kQuant ? 4 * (w.cols / w.group_size + 16) : 16;
}

void linear_bf16(const float* x, int64_t tokens, const WeightView& w, float* y) {
    const SplitX xs = split_x(x, tokens, w);
    const int64_t R = rows_per_block(w), blocks = (w.rows + R - 1) / R;
    const int team = row_schedule(blocks);
#pragma omp parallel num_threads(team)
    {
        std::vector<float> scale_buf(scale_buf_len(w)), dots(R * tokens);
#pragma omp for schedule(runtime)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t r0 = b * R, n = std::min(R, w.rows - r0);
            rows_dots(w, r0, n, xs, tokens, scale_buf.data(), dots.data());
            for (int64_t i = 0; i < n; ++i)
                for (int64_t t = 0; t < tokens; ++t) y[t * w.rows + r0 + i] = dots[i * tokens + t];
        }
    }
}

void gate_up_bf16(const float* x, int64_t tokens, const WeightView& w1, const WeightView& w3, float* h) {
    const SplitX xs = split_x(x, tokens, w1);  // w1 and w3 share a width and group size
    const int64_t ffn = w1.rows, R = rows_per_block(w1), blocks = (ffn + R - 1) / R;
    const int team = row_schedule(blocks);
#pragma omp parallel num_threads(team)
    {
        std::vector<float> scale_buf(scale_buf_len(w1)), d1(R * tokens), d3(R * tokens);
#pragma omp for schedule(runtime)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t f0 = b * R, n = std::min(R, ffn - f0);
            rows_dots(w1, f0, n, xs, tokens, scale_buf.data(), d1.data());
            rows_dots(w3, f0, n, xs, tokens, scale_buf.data(), d3.data());
            for (int64_t i = 0; i < n; ++i)
                for (int64_t t = 0; t < tokens; ++t)
                    h[t * ffn + f0 + i] = silu(d1[i * tokens + t]) * d3[i * tokens + t];
        }
    }
}
}  // namespace
void set_dynamic_rows(bool on) { g_dynamic_rows.store(on, std::memory_order_relaxed); }
bool dynamic_rows() { return g_dynamic_rows.load(std::memory_order_relaxed); }

int threads_per_call() { return team_size(); }

const char* kernel_isa() { return bf16_isa() ? "avx512_bf16" : "fp32"; }

const char* quant_decode(int bits, int64_t group_size) {
    if (!bf16_isa()) return "fp32";
    const WeightView w{WeightKind::kQuant, nullptr, nullptr, nullptr, bits, group_size, 0, 0};
    return word_codes(w) ? "words" : "lookup";
}

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
    if (bf16_path(w)) return linear_bf16(x, tokens, w, y);
    std::vector<float> xp;
    if (is_planar(w)) x = (xp = planar_x(x, tokens, w)).data();
    const int team = row_schedule(w.rows);
#pragma omp parallel num_threads(team)
    {
        std::vector<float> acc(tokens * kLanes), buf(chunk_of(w)), dots(tokens);
#pragma omp for schedule(runtime)
        for (int64_t n = 0; n < w.rows; ++n) {
            row_dots(x, tokens, w, n, acc.data(), buf.data(), dots.data());
            for (int64_t t = 0; t < tokens; ++t) y[t * w.rows + n] = dots[t];
        }
    }
}

void swiglu(const float* x, int64_t tokens, const WeightView& w1, const WeightView& w3, const WeightView& w2,
            float* h, float* y) {
    if (bf16_path(w1)) {
        gate_up_bf16(x, tokens, w1, w3, h);
        return linear(h, tokens, w2, y);
    }
    const int64_t ffn = w1.rows;
    std::vector<float> xp;  // w1 and w3 share a width and group size (checked by the bindings' caller)
    if (is_planar(w1)) x = (xp = planar_x(x, tokens, w1)).data();
    const int team = row_schedule(ffn);
#pragma omp parallel num_threads(team)
    {
        std::vector<float> acc(tokens * kLanes), buf(chunk_of(w1)), d1(tokens), d3(tokens);
#pragma omp for schedule(runtime)
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
