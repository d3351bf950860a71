// SwiGLU experts for a few tokens on the host, from bf16, fp32 or group-wise quantized weights.
// No torch headers: raw pointers in, fp32 out. OpenMP over output rows; each output is one row's fp32 sums in a fixed
// order, whatever the thread count, and a row's bytes are read from memory once per call. Two paths: where the host
// has AVX512-BF16 (checked at run time), bf16 and quantized weights take bf16 dot products (vdpbf16ps: exact
// products, fp32 sums) against x split into bf16 hi + lo, the codes decoded to bf16 in registers; elsewhere, and
// for fp32 weights, rows are decoded a chunk at a time to fp32 in L1 (64 partial sums a token).
#pragma once

#include <cstdint>

namespace maximus {
namespace expert_cpu {

enum class WeightKind : int { kBF16 = 0, kF32 = 1, kQuant = 2 };

// One weight [rows, cols] in row-major order. kQuant: `data` is the packed codes (cols * bits / 8 bytes a row:
// 8 codes in `bits` bytes, code j at bits [j * bits, (j + 1) * bits) of a little-endian word), `scales` and
// `zeros` are fp16 bit patterns [rows, cols / group_size]; a weight is code * scale + zero (ds_maximus.experts.quant).
struct WeightView {
    WeightKind kind;
    const void* data;
    const uint16_t* scales;
    const uint16_t* zeros;
    int bits;
    int64_t group_size;
    int64_t rows;
    int64_t cols;
};

// y[t, n] = sum_k x[t, k] * w[n, k] for t < tokens, n < w.rows (x: [tokens, w.cols], y: [tokens, w.rows]).
void linear(const float* x, int64_t tokens, const WeightView& w, float* y);

// y = (silu(x w1^T) * (x w3^T)) w2^T; x [tokens, hidden], w1 and w3 [ffn, hidden], w2 [hidden, ffn],
// h scratch [tokens, ffn], y [tokens, hidden].
void swiglu(const float* x, int64_t tokens, const WeightView& w1, const WeightView& w3, const WeightView& w2,
            float* h, float* y);

// The path this host runs: "avx512_bf16", or "fp32" (no AVX512-BF16, or MAXIMUS_EXPERT_CPU_FP32=1).
const char* kernel_isa();

// How the bf16 path decodes quantized codes: "words" (WordCodes: 4 and 2 bits at group sizes that tile its 64-byte
// blocks), "lookup" (the byte lookup), or "fp32" (the fp32 path: no AVX512-BF16).
const char* quant_decode(int bits, int64_t group_size);

// The threads one call runs on: the OpenMP team size (omp_get_max_threads) less one per 8, so that other host
// threads always find a free core.
int threads_per_call();

// How a call spreads a weight's row blocks over the OpenMP team: dynamically, about 8 chunks a thread, taken as
// threads come free (the default), or statically, one equal share each. With static shares a call lasts as long as
// its slowest thread, so one core taken by something else (the CUDA driver, another thread, the hypervisor) holds
// the whole call; each row's sums are the same either way. Process-wide; the probe scripts compare the two.
void set_dynamic_rows(bool on);
bool dynamic_rows();

// The fp16 bit pattern's value (exact).
float half_to_float(uint16_t h);

}  // namespace expert_cpu
}  // namespace maximus
