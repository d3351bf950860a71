// CPU kernels of maximus_row_ops (at::parallel_for, i.e. OpenMP threads).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "row_ops/cpu/bf16_copy.h"
#include "row_ops/row_math.h"
#include "row_ops/row_ops.h"

namespace maximus {

namespace {
template <typename T>
void gather_rows(const float* table, const int64_t* slots, const int64_t* inverse, T* out, int64_t N, int64_t d) {
    at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
        for (int64_t n = b; n < e; ++n) {
            const float* src = table + slots[inverse[n]] * d;
            T* dst = out + n * d;
            for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<T>(src[j]);
        }
    });
}

template <typename T>
void segment_rows(const T* grad, const int64_t* order, const int64_t* offsets, float* out, int64_t U, int64_t d) {
    at::parallel_for(0, U, 16, [&](int64_t b, int64_t e) {
        for (int64_t u = b; u < e; ++u) {
            float* dst = out + u * d;
            for (int64_t j = 0; j < d; ++j) dst[j] = 0.f;
            for (int64_t i = offsets[u]; i < offsets[u + 1]; ++i) {
                const T* src = grad + order[i] * d;
                for (int64_t j = 0; j < d; ++j) dst[j] += static_cast<float>(src[j]);
            }
        }
    });
}
}  // namespace

void gather_cpu(const at::Tensor& table, const at::Tensor& slots, const at::Tensor& inverse, at::Tensor& out) {
    TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() && table.dim() == 2,
                "gather: table must be contiguous fp32 [rows, dim]");
    TORCH_CHECK(slots.scalar_type() == at::kLong && inverse.scalar_type() == at::kLong, "gather: int64 indices");
    TORCH_CHECK(out.is_contiguous() && out.size(0) == inverse.numel() && out.size(1) == table.size(1),
                "gather: out must be contiguous [len(inverse), dim]");
    auto sl = slots.contiguous();
    auto inv = inverse.contiguous();
    const int64_t N = inv.numel(), d = table.size(1);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "maximus_gather_cpu", [&] {
        gather_rows<scalar_t>(table.data_ptr<float>(), sl.data_ptr<int64_t>(), inv.data_ptr<int64_t>(),
                              out.data_ptr<scalar_t>(), N, d);
    });
}

void segment_reduce_cpu(const at::Tensor& grad, const at::Tensor& inverse, at::Tensor& out) {
    TORCH_CHECK(grad.dim() == 2 && grad.is_contiguous(), "segment_reduce: grad must be contiguous [N, dim]");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(1) == grad.size(1),
                "segment_reduce: out must be contiguous fp32 [U, dim]");
    auto inv = inverse.contiguous();
    const int64_t N = grad.size(0), U = out.size(0), d = grad.size(1);
    // counting sort of token positions by unique id (stable: token order within an id)
    std::vector<int64_t> offsets(U + 1, 0), order(N), fill;
    const int64_t* iv = inv.data_ptr<int64_t>();
    for (int64_t n = 0; n < N; ++n) {
        TORCH_CHECK(iv[n] >= 0 && iv[n] < U, "segment_reduce: inverse index out of range");
        ++offsets[iv[n] + 1];
    }
    for (int64_t u = 0; u < U; ++u) offsets[u + 1] += offsets[u];
    fill.assign(offsets.begin(), offsets.end() - 1);
    for (int64_t n = 0; n < N; ++n) order[fill[iv[n]]++] = n;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "maximus_segment_reduce_cpu", [&] {
        segment_rows<scalar_t>(grad.data_ptr<scalar_t>(), order.data(), offsets.data(), out.data_ptr<float>(), U, d);
    });
}

namespace {
// One optimizer step over ``d`` contiguous elements of one row, specialised per optimizer, mode and whether a
// gradient is given (a replayed step has none), so that the loop has no branch and no aliasing: the compiler
// vectorises it (the per-element dispatch through ``update_elem`` ran at ~1/7 of DeepSpeed's CPU Adam).
// Same element math, in the same order, as ``update_elem``.
// ``gs`` scales the gradient exactly as ``grad.mul_(gs)`` before the call would: the op is built with
// -ffp-contract=off (op_builder/row_ops.py), so the product is rounded before the update uses it (the
// update's own multiply-adds are explicit fmaf calls, row_math.h) and the CPU side of a split step equals the
// device side, which scales in its own kernel.
// A gradient element as fp32: fp32 itself, or bf16 given as its bits (exact: bf16 is fp32's upper half).
inline float grad_at(const float* __restrict__ g, int64_t j) { return g[j]; }
inline float grad_at(const uint16_t* __restrict__ g, int64_t j) {
    const uint32_t bits = static_cast<uint32_t>(g[j]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

// ``GT``: the gradient's element type (float, or uint16_t for bf16: a bf16 expert gradient reads half the bytes).
template <int OPT, bool LAZY, bool HAS_G, typename GT>
void update_span(float* __restrict__ p, float* __restrict__ m, float* __restrict__ v, const void* gv, int64_t d,
                 const StepCoeffs c, const float gs) {
    const GT* __restrict__ g = static_cast<const GT*>(gv);
    if constexpr (OPT == kAdagrad) {
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) adagrad_elem(p[j], m[j], HAS_G ? grad_at(g, j) * gs : 0.f, c);
    } else if constexpr (LAZY) {
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) sparse_adam_elem(p[j], m[j], v[j], HAS_G ? grad_at(g, j) * gs : 0.f, c);
    } else {
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) adamw_elem(p[j], m[j], v[j], HAS_G ? grad_at(g, j) * gs : 0.f, c);
    }
}

using SpanFn = void (*)(float*, float*, float*, const void*, int64_t, const StepCoeffs, const float);

template <typename T>
void cast_span(T* __restrict__ dst, const float* __restrict__ src, int64_t d) {
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<T>(src[j]);
}

// fp32 -> bf16: bf16_copy.h (streaming stores where the CPU has AVX2).
template <>
void cast_span<c10::BFloat16>(c10::BFloat16* __restrict__ dst, const float* __restrict__ src, int64_t d) {
    bf16_copy(reinterpret_cast<uint16_t*>(dst), src, d);
}

template <typename GT>
SpanFn span_fn_for(int opt, bool lazy, bool has_g) {
    if (opt == kAdagrad)
        return has_g ? update_span<kAdagrad, false, true, GT> : update_span<kAdagrad, false, false, GT>;
    if (lazy) return has_g ? update_span<kAdamW, true, true, GT> : update_span<kAdamW, true, false, GT>;
    return has_g ? update_span<kAdamW, false, true, GT> : update_span<kAdamW, false, false, GT>;
}

SpanFn span_fn(int opt, bool lazy, bool has_g, bool bf16_grad = false) {
    return bf16_grad ? span_fn_for<uint16_t>(opt, lazy, has_g) : span_fn_for<float>(opt, lazy, has_g);
}
}  // namespace

void row_update_cpu(at::Tensor& weight, at::Tensor& s0, at::Tensor& s1, const at::Tensor& slots,
                    const at::Tensor& grads, const at::Tensor& last_step, const at::Tensor& lr_hist,
                    const at::Tensor& wd_hist, const RowUpdateArgs& a, const at::Tensor& shadow) {
    check_update_args(weight, s0, s1, slots, grads, last_step, lr_hist, wd_hist, a);
    const bool has_shadow = shadow.defined() && shadow.numel() > 0;
    TORCH_CHECK(!has_shadow || (shadow.sizes() == weight.sizes() && shadow.is_contiguous() && !shadow.is_cuda() &&
                                (shadow.scalar_type() == at::kBFloat16 || shadow.scalar_type() == at::kHalf ||
                                 shadow.scalar_type() == at::kFloat)),
                "row_update: shadow must be a contiguous CPU bf16/fp16/fp32 tensor shaped like weight");
    const int64_t R = slots.numel(), d = weight.size(1), rows = weight.size(0);
    void* SH = has_shadow ? shadow.data_ptr() : nullptr;
    const at::ScalarType sh_type = has_shadow ? shadow.scalar_type() : at::kFloat;
    float* W = weight.data_ptr<float>();
    float* S0 = s0.data_ptr<float>();
    float* S1 = a.optimizer == kAdagrad ? nullptr : s1.data_ptr<float>();
    const int64_t* sl = slots.data_ptr<int64_t>();
    const char* G = a.has_grad ? static_cast<const char*>(grads.data_ptr()) : nullptr;
    const bool bf16_grad = a.has_grad && grads.scalar_type() == at::kBFloat16;
    const int64_t grad_row_bytes = a.has_grad ? d * grads.element_size() : 0;
    const int64_t* last = a.lazy ? nullptr : last_step.data_ptr<int64_t>();
    const double* lrh = a.lazy ? nullptr : lr_hist.data_ptr<double>();
    const double* wdh = a.lazy ? nullptr : wd_hist.data_ptr<double>();
    for (int64_t r = 0; r < R; ++r) TORCH_CHECK(sl[r] >= 0 && sl[r] < rows, "row_update: slot out of range");
    const StepCoeffs gc = step_coeffs(a.optimizer, a.lazy, a.lr, a.weight_decay, a.beta1, a.beta2, a.eps, a.step);
    const SpanFn replay = span_fn(a.optimizer, false, false);
    const SpanFn update = span_fn(a.optimizer, a.lazy, true, bf16_grad);
    // exact mode: the coefficients of every step some row replays, computed once per call (three double
    // pows each) instead of once per row and skipped step; the same values, so the same results
    const int64_t end = a.has_grad ? a.step - 1 : a.step;
    int64_t k_lo = end + 1;
    if (!a.lazy)
        for (int64_t r = 0; r < R; ++r) k_lo = std::min(k_lo, last[r] + 1);
    std::vector<StepCoeffs> coeffs(static_cast<size_t>(std::max<int64_t>(0, end - k_lo + 1)));
    at::parallel_for(0, static_cast<int64_t>(coeffs.size()), 256, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i)
            coeffs[i] = step_coeffs(a.optimizer, false, lrh[k_lo + i], wdh[k_lo + i], a.beta1, a.beta2, a.eps, k_lo + i);
    });
    at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
            float* p = W + sl[r] * d;
            float* m = S0 + sl[r] * d;
            float* v = S1 ? S1 + sl[r] * d : nullptr;
            if (!a.lazy) {
                for (int64_t k = last[r] + 1; k <= end; ++k) {
                    if (replay_is_noop(a.optimizer, wdh[k])) continue;
                    replay(p, m, v, nullptr, d, coeffs[k - k_lo], 1.f);
                }
            }
            if (G) update(p, m, v, G + r * grad_row_bytes, d, gc, a.grad_scale);
            if (SH != nullptr) {  // the row is still in cache
                const int64_t off = sl[r] * d;
                switch (sh_type) {
                    case at::kBFloat16: cast_span(static_cast<c10::BFloat16*>(SH) + off, p, d); break;
                    case at::kHalf: cast_span(static_cast<c10::Half*>(SH) + off, p, d); break;
                    default: cast_span(static_cast<float*>(SH) + off, p, d);
                }
            }
        }
    });
}

}  // namespace maximus
