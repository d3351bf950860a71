// An expert gradient's micro-batch sum on the host (ExpertGrads): out = base * factor + add_1 + ... + add_k,
// elementwise in fp32 with the device's roundings, in the order given (widen, multiply, round, then add and round
// one part at a time: the op is built with -ffp-contract=off, so no fused multiply-add), with the sum's squared norm
// and finiteness. One pass over memory: each chunk of out stays in cache while the parts are added to it, so base
// and every part are read once and out written once (~4 + 2k bytes an element for k bf16 parts), where k - 1 calls
// of a two-operand sum would read and write out k times.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <vector>

#include "row_ops/row_ops.h"

namespace maximus {

namespace {
constexpr int64_t kGrain = 1 << 14;  // 64 KiB of fp32 out a chunk: in L2 while every part is added

template <typename B, typename A>
std::tuple<double, bool> grad_sum_typed(float* out, const B* base, float factor, const std::vector<const A*>& adds,
                                        int64_t n) {
    const int64_t chunks = (n + kGrain - 1) / kGrain;
    const size_t k = adds.size();
    std::vector<double> sq(chunks, 0.0);
    std::vector<char> ok(chunks, 1);
    at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
        for (int64_t c = b; c < e; ++c) {
            const int64_t lo = c * kGrain, hi = std::min(n, lo + kGrain);
            if (k == 0) {
#pragma omp simd
                for (int64_t i = lo; i < hi; ++i) out[i] = static_cast<float>(base[i]) * factor;
            } else {  // v * 1.f is v: the multiply is always made (it vectorises)
                const A* a = adds[0];
#pragma omp simd
                for (int64_t i = lo; i < hi; ++i)
                    out[i] = static_cast<float>(base[i]) * factor + static_cast<float>(a[i]);
            }
            for (size_t p = 1; p < k; ++p) {
                const A* a = adds[p];
#pragma omp simd
                for (int64_t i = lo; i < hi; ++i) out[i] = out[i] + static_cast<float>(a[i]);
            }
            double acc = 0.0;
            int64_t bad = 0;
#pragma omp simd reduction(+ : acc, bad)
            for (int64_t i = lo; i < hi; ++i) {
                const float v = out[i];
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

template <typename A>
std::vector<const A*> pointers(const std::vector<at::Tensor>& adds) {
    std::vector<const A*> out;
    for (const auto& t : adds) out.push_back(t.data_ptr<A>());
    return out;
}

template <typename B>
std::tuple<double, bool> grad_sum_adds(float* out, const B* base, float factor, const std::vector<at::Tensor>& adds,
                                       int64_t n) {
    switch (adds.empty() ? at::kFloat : adds[0].scalar_type()) {
        case at::kFloat: return grad_sum_typed(out, base, factor, pointers<float>(adds), n);
        case at::kBFloat16: return grad_sum_typed(out, base, factor, pointers<c10::BFloat16>(adds), n);
        case at::kHalf: return grad_sum_typed(out, base, factor, pointers<c10::Half>(adds), n);
        default:
            TORCH_CHECK(false, "grad_sum: parts must be float32, bfloat16 or float16, got ", adds[0].scalar_type());
    }
}
}  // namespace

std::tuple<double, bool> grad_sum_parts_cpu(at::Tensor& out, const at::Tensor& base, double factor,
                                            const std::vector<at::Tensor>& adds) {
    TORCH_CHECK(!out.is_cuda() && !base.is_cuda(), "grad_sum is a CPU op");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), "grad_sum: out must be contiguous float32");
    TORCH_CHECK(base.is_contiguous(), "grad_sum: base must be contiguous");
    const int64_t n = out.numel();
    TORCH_CHECK(base.numel() == n, "grad_sum: out and base differ in size (", n, ", ", base.numel(), ")");
    for (const auto& a : adds)
        TORCH_CHECK(!a.is_cuda() && a.is_contiguous() && a.numel() == n && a.scalar_type() == adds[0].scalar_type(),
                    "grad_sum: every part must be a contiguous CPU tensor of out's size and the first part's dtype");
    float* o = out.data_ptr<float>();
    const float f = static_cast<float>(factor);
    switch (base.scalar_type()) {
        case at::kFloat: return grad_sum_adds(o, base.data_ptr<float>(), f, adds, n);
        case at::kBFloat16: return grad_sum_adds(o, base.data_ptr<c10::BFloat16>(), f, adds, n);
        case at::kHalf: return grad_sum_adds(o, base.data_ptr<c10::Half>(), f, adds, n);
        default: TORCH_CHECK(false, "grad_sum: base must be float32, bfloat16 or float16, got ", base.scalar_type());
    }
}

std::tuple<double, bool> grad_sum_cpu(at::Tensor& out, const at::Tensor& base, double factor, const at::Tensor& add) {
    return grad_sum_parts_cpu(out, base, factor, {add});
}

}  // namespace maximus
