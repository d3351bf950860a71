// The only PYBIND11_MODULE of maximus_expert_cpu: torch glue over common/expert_kernels (which has no torch
// headers). Checks shapes, dtypes and layouts, then runs the kernels with the GIL released, so the host computes
// an expert while Python queues the device's work.
#include <omp.h>
#include <torch/extension.h>

#include "expert_cpu/common/expert_kernels.h"

namespace ec = maximus::expert_cpu;
using namespace pybind11::literals;

namespace {

ec::WeightView dense_view(const torch::Tensor& w, const char* name) {
    TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous(), name,
                " must be a contiguous 2-D CPU tensor, got ", w.sizes(), " on ", w.device());
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16 || w.scalar_type() == torch::kFloat32, name,
                " must be bfloat16 or float32, got ", w.scalar_type());
    const bool bf16 = w.scalar_type() == torch::kBFloat16;
    return {bf16 ? ec::WeightKind::kBF16 : ec::WeightKind::kF32, w.data_ptr(), nullptr, nullptr, 0, 0, w.size(0),
            w.size(1)};
}

ec::WeightView quant_view(const torch::Tensor& packed, const torch::Tensor& scales, const torch::Tensor& zeros,
                          int64_t bits, int64_t group_size, int64_t cols, const char* name) {
    TORCH_CHECK(bits == 8 || bits == 4 || bits == 3 || bits == 2, name, ": bits must be 8, 4, 3 or 2, got ", bits);
    TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && cols % group_size == 0, name, ": group_size ", group_size,
                " must be a positive multiple of 8 dividing cols ", cols);
    for (const auto* t : {&packed, &scales, &zeros})
        TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 && t->is_contiguous(), name,
                    ": packed, scales and zeros must be contiguous 2-D CPU tensors");
    TORCH_CHECK(packed.scalar_type() == torch::kUInt8, name, ": packed codes must be uint8");
    TORCH_CHECK(scales.scalar_type() == torch::kFloat16 && zeros.scalar_type() == torch::kFloat16, name,
                ": scales and zeros must be float16");
    const int64_t rows = packed.size(0);
    TORCH_CHECK(packed.size(1) == cols * bits / 8, name, ": packed has ", packed.size(1), " bytes a row, expected ",
                cols * bits / 8);
    TORCH_CHECK(scales.size(0) == rows && zeros.size(0) == rows && scales.size(1) == cols / group_size &&
                    zeros.size(1) == cols / group_size,
                name, ": scales and zeros must be [rows, cols / group_size]");
    return {ec::WeightKind::kQuant, packed.data_ptr(),
            reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
            reinterpret_cast<const uint16_t*>(zeros.data_ptr<at::Half>()), static_cast<int>(bits), group_size, rows,
            cols};
}

void check_x(const torch::Tensor& x, int64_t cols) {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
                "x must be a contiguous 2-D float32 CPU tensor");
    TORCH_CHECK(x.size(1) == cols, "x has ", x.size(1), " features, the weight ", cols);
}

torch::Tensor run_linear(const torch::Tensor& x, const ec::WeightView& w) {
    check_x(x, w.cols);
    auto y = torch::empty({x.size(0), w.rows}, x.options());
    {
        pybind11::gil_scoped_release no_gil;
        ec::linear(x.data_ptr<float>(), x.size(0), w, y.data_ptr<float>());
    }
    return y;
}

torch::Tensor run_swiglu(const torch::Tensor& x, const ec::WeightView& w1, const ec::WeightView& w3,
                         const ec::WeightView& w2) {
    TORCH_CHECK(w1.rows == w3.rows && w1.cols == w3.cols && w2.rows == w1.cols && w2.cols == w1.rows,
                "expert shapes disagree: w1 [", w1.rows, ", ", w1.cols, "], w3 [", w3.rows, ", ", w3.cols, "], w2 [",
                w2.rows, ", ", w2.cols, "]; expected w1, w3 [ffn, hidden] and w2 [hidden, ffn]");
    check_x(x, w1.cols);
    auto h = torch::empty({x.size(0), w1.rows}, x.options());
    auto y = torch::empty({x.size(0), w2.rows}, x.options());
    {
        pybind11::gil_scoped_release no_gil;
        ec::swiglu(x.data_ptr<float>(), x.size(0), w1, w3, w2, h.data_ptr<float>(), y.data_ptr<float>());
    }
    return y;
}

torch::Tensor linear_dense(const torch::Tensor& x, const torch::Tensor& w) { return run_linear(x, dense_view(w, "w")); }

torch::Tensor linear_quant(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                           const torch::Tensor& zeros, int64_t bits, int64_t group_size) {
    return run_linear(x, quant_view(packed, scales, zeros, bits, group_size, x.size(1), "w"));
}

torch::Tensor swiglu_dense(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& w3,
                           const torch::Tensor& w2) {
    return run_swiglu(x, dense_view(w1, "w1"), dense_view(w3, "w3"), dense_view(w2, "w2"));
}

torch::Tensor swiglu_quant(const torch::Tensor& x, const std::vector<torch::Tensor>& w1,
                           const std::vector<torch::Tensor>& w3, const std::vector<torch::Tensor>& w2, int64_t bits,
                           int64_t group_size, int64_t ffn) {
    TORCH_CHECK(w1.size() == 3 && w3.size() == 3 && w2.size() == 3,
                "each quantized weight is (packed, scales, zeros)");
    const int64_t hidden = x.size(1);
    return run_swiglu(x, quant_view(w1[0], w1[1], w1[2], bits, group_size, hidden, "w1"),
                      quant_view(w3[0], w3[1], w3[2], bits, group_size, hidden, "w3"),
                      quant_view(w2[0], w2[1], w2[2], bits, group_size, ffn, "w2"));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "maximus_expert_cpu: SwiGLU experts for a few tokens on the host (bf16, fp32 or quantized weights)";
    m.def("linear_dense", &linear_dense, "y = x w^T, fp32 accumulation; w bf16 or fp32 [rows, cols]", "x"_a, "w"_a);
    m.def("linear_quant", &linear_quant, "y = x dequant(w)^T from packed codes, fp16 scales and zeros", "x"_a,
          "packed"_a, "scales"_a, "zeros"_a, "bits"_a, "group_size"_a);
    m.def("swiglu_dense", &swiglu_dense, "y = (silu(x w1^T) * (x w3^T)) w2^T from bf16 or fp32 weights", "x"_a,
          "w1"_a, "w3"_a, "w2"_a);
    m.def("swiglu_quant", &swiglu_quant, "the SwiGLU expert from quantized weights, each (packed, scales, zeros)",
          "x"_a, "w1"_a, "w3"_a, "w2"_a, "bits"_a, "group_size"_a, "ffn"_a);
    m.def("kernel_isa", [] { return std::string(ec::kernel_isa()); },
          "the path this host runs: avx512_bf16 (bf16 dot products) or fp32");
    m.def("quant_decode", [](int64_t bits, int64_t group_size) {
              return std::string(ec::quant_decode(static_cast<int>(bits), group_size));
          }, "how quantized codes are decoded: words, lookup or fp32", "bits"_a, "group_size"_a);
    m.def("omp_max_threads", [] { return omp_get_max_threads(); }, "the OpenMP team size (torch's threads)");
    m.def("threads_per_call", &ec::threads_per_call, "threads a call runs on: the team size less one per 8");
    m.def("set_dynamic_rows", &ec::set_dynamic_rows, "spread row blocks dynamically (true) or in static shares",
          "on"_a);
    m.def("dynamic_rows", &ec::dynamic_rows, "whether row blocks are spread dynamically");
}
