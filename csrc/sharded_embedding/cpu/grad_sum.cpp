// An expert gradient's micro-batch sum on the host (ExpertGrads' host accumulation): out = base * factor + add,
// elementwise in fp32 with the device's roundings (widen, multiply, round, add, round: the op is built with
// -ffp-contract=off, so no fused multiply-add), with the sum's squared norm and finiteness from the same pass.
// One pass of ~10 bytes an element, where torch's ops take four (mul_, add_, dot, isfinite).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <vector>

#include "sharded_embedding/sharded_embedding.h"

namespace maximus {

namespace {
template <typename B, typename A>
std::tuple<double, bool> grad_sum_typed(float* out, const B* base, float factor, const A* add, int64_t n) {
    constexpr int64_t kGrain = 1 << 16;
    const int64_t chunks = (n + kGrain - 1) / kGrain;
    std::vector<double> sq(chunks, 0.0);
    std::vector<char> ok(chunks, 1);
    at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
        for (int64_t c = b; c < e; ++c) {
            const int64_t lo = c * kGrain, hi = std::min(n, lo + kGrain);
            double acc = 0.0;
            int64_t bad = 0;
#pragma omp simd reduction(+ : acc, bad)
            for (int64_t i = lo; i < hi; ++i) {  // v * 1.f is v: the multiply is always made (it vectorises)
                const float v = static_cast<float>(base[i]) * factor + static_cast<float>(add[i]);
                out[i] = v;
                acc += static_cast<double>(v) * v;
                bad += (v - v != 0.f);  // inf - inf and NaN are NaN: the finiteness test without a branch
            }
            sq[c] = acc;
            ok[c] = bad == 0;
        }
    });
    double total = 0.0;
    bool finite = true;
    for (int64_t c = 0; c < chunks; ++c) {
        total += sq[c];
        finite = finite && ok[c];
    }
    return {total, finite};
}

template <typename B>
std::tuple<double, bool> grad_sum_add(float* out, const B* base, float factor, const at::Tensor& add, int64_t n) {
    switch (add.scalar_type()) {
        case at::kFloat: return grad_sum_typed(out, base, factor, add.data_ptr<float>(), n);
        case at::kBFloat16: return grad_sum_typed(out, base, factor, add.data_ptr<c10::BFloat16>(), n);
        case at::kHalf: return grad_sum_typed(out, base, factor, add.data_ptr<c10::Half>(), n);
        default: TORCH_CHECK(false, "grad_sum: add must be float32, bfloat16 or float16, got ", add.scalar_type());
    }
}
}  // namespace

std::tuple<double, bool> grad_sum_cpu(at::Tensor& out, const at::Tensor& base, double factor, const at::Tensor& add) {
    TORCH_CHECK(!out.is_cuda() && !base.is_cuda() && !add.is_cuda(), "grad_sum is a CPU op");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), "grad_sum: out must be contiguous float32");
    TORCH_CHECK(base.is_contiguous() && add.is_contiguous(), "grad_sum: base and add must be contiguous");
    const int64_t n = out.numel();
    TORCH_CHECK(base.numel() == n && add.numel() == n, "grad_sum: out, base and add differ in size (", n, ", ",
                base.numel(), ", ", add.numel(), ")");
    float* o = out.data_ptr<float>();
    const float f = static_cast<float>(factor);
    switch (base.scalar_type()) {
        case at::kFloat: return grad_sum_add(o, base.data_ptr<float>(), f, add, n);
        case at::kBFloat16: return grad_sum_add(o, base.data_ptr<c10::BFloat16>(), f, add, n);
        case at::kHalf: return grad_sum_add(o, base.data_ptr<c10::Half>(), f, add, n);
        default: TORCH_CHECK(false, "grad_sum: base must be float32, bfloat16 or float16, got ", base.scalar_type());
    }
}

}  // namespace maximus
