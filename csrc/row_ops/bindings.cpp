// The only PYBIND11_MODULE of maximus_row_ops (CPU op) and maximus_row_ops_cuda
// (CUDA op, built with MAXIMUS_WITH_CUDA; it serves CPU tensors too).
#include "row_ops/row_ops.h"

namespace maximus {
namespace {

void gather(const at::Tensor& table, const at::Tensor& slots, const at::Tensor& inverse, at::Tensor& out) {
#ifdef MAXIMUS_WITH_CUDA
    if (table.is_cuda()) return gather_cuda(table, slots, inverse, out);
#endif
    TORCH_CHECK(!table.is_cuda(), "maximus_row_ops (CPU op) got a CUDA tensor; use the CUDA op");
    gather_cpu(table, slots, inverse, out);
}

void segment_reduce(const at::Tensor& grad, const at::Tensor& order, const at::Tensor& offsets, at::Tensor& out) {
#ifdef MAXIMUS_WITH_CUDA
    if (grad.is_cuda()) return segment_reduce_cuda(grad, order, offsets, out);
#endif
    TORCH_CHECK(false, "segment_reduce(order, offsets) is the CUDA entry; on CPU call segment_reduce_cpu");
}

void row_update(at::Tensor& weight, at::Tensor& s0, at::Tensor& s1, const at::Tensor& slots, const at::Tensor& grads,
                const at::Tensor& last_step, const at::Tensor& lr_hist, const at::Tensor& wd_hist, int64_t step,
                double lr, double weight_decay, double beta1, double beta2, double eps, int64_t optimizer, bool lazy,
                bool has_grad) {
    RowUpdateArgs a{step, lr, weight_decay, beta1, beta2, eps, (int)optimizer, lazy, has_grad};
#ifdef MAXIMUS_WITH_CUDA
    if (weight.is_cuda()) return row_update_cuda(weight, s0, s1, slots, grads, last_step, lr_hist, wd_hist, a);
#endif
    TORCH_CHECK(!weight.is_cuda(), "maximus_row_ops (CPU op) got a CUDA tensor; use the CUDA op");
    row_update_cpu(weight, s0, s1, slots, grads, last_step, lr_hist, wd_hist, a);
}

// CPU only: ``row_update`` with the gradient scaled by ``grad_scale`` and the updated rows also written, cast,
// into ``shadow`` (empty: none), in the same pass (an expert stepped on the CPU tier: clip factor and compute copy).
void row_update_scaled(at::Tensor& weight, at::Tensor& s0, at::Tensor& s1, const at::Tensor& slots,
                       const at::Tensor& grads, const at::Tensor& last_step, const at::Tensor& lr_hist,
                       const at::Tensor& wd_hist, int64_t step, double lr, double weight_decay, double beta1,
                       double beta2, double eps, int64_t optimizer, bool lazy, bool has_grad, double grad_scale,
                       const at::Tensor& shadow) {
    TORCH_CHECK(!weight.is_cuda(), "row_update_scaled is the CPU entry; on a GPU scale the gradient first");
    RowUpdateArgs a{step, lr, weight_decay, beta1, beta2, eps, (int)optimizer, lazy, has_grad};
    a.grad_scale = (float)grad_scale;
    row_update_cpu(weight, s0, s1, slots, grads, last_step, lr_hist, wd_hist, a, shadow);
}

void copy_rows(const at::Tensor& src, const at::Tensor& src_idx, at::Tensor& dst, const at::Tensor& dst_idx,
               int64_t max_blocks) {
#ifdef MAXIMUS_WITH_CUDA
    return copy_rows_cuda(src, src_idx, dst, dst_idx, max_blocks);
#else
    (void)max_blocks;
    TORCH_CHECK(false, "copy_rows needs the CUDA op (maximus_row_ops_cuda)");
#endif
}

}  // namespace
}  // namespace maximus

// Every op runs without the GIL: they touch tensors only, and a CPU row update of a Mixtral expert takes
// tens of ms that another Python thread (the GPU half of a split expert step) must not wait for.
using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    using namespace pybind11::literals;
    m.doc() = "maximus_row_ops: slot-map gather, row-sparse backward, fused sparse AdamW/Adagrad";
    m.def("gather", &maximus::gather, "out[n] = table[slots[inverse[n]]] cast to out.dtype", "table"_a, "slots"_a,
          "inverse"_a, "out"_a, nogil());
    m.def("segment_reduce_cpu", &maximus::segment_reduce_cpu, "out[u] = sum of grad rows with inverse == u (fp32)",
          "grad"_a, "inverse"_a, "out"_a, nogil());
    m.def("segment_reduce", &maximus::segment_reduce, "CUDA: sum grad[order[offsets[u]:offsets[u+1]]] into out[u]",
          "grad"_a, "order"_a, "offsets"_a, "out"_a, nogil());
    m.def("copy_rows", &maximus::copy_rows, "dst[dst_idx] = src[src_idx] by a GPU kernel; either may be pinned host",
          "src"_a, "src_idx"_a, "dst"_a, "dst_idx"_a, "max_blocks"_a = 0, nogil());
    m.def("slot_assign", &maximus::slot_assign_cpu,
          "SlotMap.assign on CPU tensors: (status, slots, miss positions, victims, evicted ids, evicted slots)",
          "ids"_a, "id_to_slot"_a, "slot_to_id"_a, "last_use"_a, "slot_freq"_a, "id_freq"_a, "pin_count"_a,
          "clock"_a, "lfu"_a, nogil());
    m.def("batch_plan", &maximus::batch_plan_cpu,
          "sorted unique ids of a CPU batch into uniq_out, [inverse | stable order | offsets] into idx_out; returns U "
          "(-1 - n when id n is outside the vocabulary, nothing written)",
          "ids"_a, "mask"_a, "rank"_a, "uniq_out"_a, "idx_out"_a, nogil());
    m.def("grad_sum", &maximus::grad_sum_cpu,
          "CPU: out = base * factor + add in fp32 (base may be out); returns (sum of out^2, every element finite)",
          "out"_a, "base"_a, "factor"_a, "add"_a, nogil());
    m.def("grad_sum_parts", &maximus::grad_sum_parts_cpu,
          "CPU: out = base * factor + adds[0] + adds[1] + ... in fp32, in order, one pass (base may be out); returns "
          "(sum of out^2, every element finite)",
          "out"_a, "base"_a, "factor"_a, "adds"_a, nogil());
    m.def("row_update", &maximus::row_update, "fused exact-replay + AdamW/SparseAdam/Adagrad step on rows", "weight"_a,
          "s0"_a, "s1"_a, "slots"_a, "grads"_a, "last_step"_a, "lr_hist"_a, "wd_hist"_a, "step"_a, "lr"_a,
          "weight_decay"_a, "beta1"_a, "beta2"_a, "eps"_a, "optimizer"_a = 0, "lazy"_a = false, "has_grad"_a = true,
          nogil());
    m.def("row_update_scaled", &maximus::row_update_scaled,
          "CPU: row_update with grad * grad_scale, the updated rows also cast into shadow (empty: none)", "weight"_a,
          "s0"_a, "s1"_a, "slots"_a, "grads"_a, "last_step"_a, "lr_hist"_a, "wd_hist"_a, "step"_a, "lr"_a,
          "weight_decay"_a, "beta1"_a, "beta2"_a, "eps"_a, "optimizer"_a, "lazy"_a, "has_grad"_a, "grad_scale"_a,
          "shadow"_a, nogil());
}
