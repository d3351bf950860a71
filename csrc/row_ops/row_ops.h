// Kernels of maximus_row_ops: gather through a slot map, row-sparse backward
// (segment reduce), fused sparse optimizer with exact replay. References: ds_maximus/vocab/reference.py.
#pragma once
#include <torch/extension.h>

namespace maximus {

struct RowUpdateArgs {
    int64_t step;
    double lr, weight_decay, beta1, beta2, eps;
    int optimizer;
    bool lazy, has_grad;
    float grad_scale = 1.f;  // the gradient step uses grad * grad_scale (CPU entry row_update_scaled only)
};

void gather_cpu(const at::Tensor& table, const at::Tensor& slots, const at::Tensor& inverse, at::Tensor& out);
void segment_reduce_cpu(const at::Tensor& grad, const at::Tensor& inverse, at::Tensor& out);
// ``shadow`` (undefined, or [rows, dim] bf16/fp16/fp32 like weight): the updated rows are also written there,
// cast, in the same pass (the compute copy of an expert stepped on the CPU tier).
void row_update_cpu(at::Tensor& weight, at::Tensor& s0, at::Tensor& s1, const at::Tensor& slots,
                    const at::Tensor& grads, const at::Tensor& last_step, const at::Tensor& lr_hist,
                    const at::Tensor& wd_hist, const RowUpdateArgs& a, const at::Tensor& shadow = at::Tensor());

// SlotMap.assign of ds_maximus/partition/policy.py in one call; returns (status: 0 ok, 1 more misses than slots,
// 2 too few unpinned slots; slots, miss positions, victim slots, evicted ids, their slots). No change on failure.
std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> slot_assign_cpu(
    const at::Tensor& ids, at::Tensor& id_to_slot, at::Tensor& slot_to_id, at::Tensor& last_use,
    at::Tensor& slot_freq, at::Tensor& id_freq, const at::Tensor& pin_count, double clock, bool lfu);
// BatchPlanner.plan of ds_maximus/vocab/function.py: writes the U sorted unique ids of ``ids`` to uniq_out and
// [inverse (N) | stable order (N) | offsets (U + 1)] to idx_out; returns U. ``mask`` (bool, vocabulary-sized) must
// be all false and is left so; ``rank`` (int64, vocabulary-sized) is scratch.
// out = base * factor + add (fp32 elementwise, as the device does it); returns (sum of out^2, all finite).
std::tuple<double, bool> grad_sum_cpu(at::Tensor& out, const at::Tensor& base, double factor, const at::Tensor& add);
// out = base * factor + adds[0] + ... (each addition rounded in fp32, in order; base may be out): one pass.
std::tuple<double, bool> grad_sum_parts_cpu(at::Tensor& out, const at::Tensor& base, double factor,
                                            const std::vector<at::Tensor>& adds);

int64_t batch_plan_cpu(const at::Tensor& ids, at::Tensor& mask, at::Tensor& rank, at::Tensor& uniq_out,
                       at::Tensor& idx_out);
#ifdef MAXIMUS_WITH_CUDA
void gather_cuda(const at::Tensor& table, const at::Tensor& slots, const at::Tensor& inverse, at::Tensor& out);
void segment_reduce_cuda(const at::Tensor& grad, const at::Tensor& order, const at::Tensor& offsets,
                         at::Tensor& out);
void copy_rows_cuda(const at::Tensor& src, const at::Tensor& src_idx, at::Tensor& dst, const at::Tensor& dst_idx,
                    int64_t max_blocks);
void row_update_cuda(at::Tensor& weight, at::Tensor& s0, at::Tensor& s1, const at::Tensor& slots,
                     const at::Tensor& grads, const at::Tensor& last_step, const at::Tensor& lr_hist,
                     const at::Tensor& wd_hist, const RowUpdateArgs& a);
#endif

inline void check_update_args(const at::Tensor& weight, const at::Tensor& s0, const at::Tensor& s1,
                              const at::Tensor& slots, const at::Tensor& grads, const at::Tensor& last_step,
                              const at::Tensor& lr_hist, const at::Tensor& wd_hist, const RowUpdateArgs& a) {
    TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
                "row_update: weight must be a contiguous fp32 [rows, dim] tensor");
    TORCH_CHECK(s0.sizes() == weight.sizes() && s0.scalar_type() == at::kFloat && s0.is_contiguous(),
                "row_update: state 0 must match weight");
    TORCH_CHECK(a.optimizer == 1 || (s1.sizes() == weight.sizes() && s1.scalar_type() == at::kFloat &&
                                     s1.is_contiguous()),
                "row_update: AdamW needs a second state tensor matching weight");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "row_update: slots must be int64");
    const int64_t R = slots.numel();
    const bool grad_dtype_ok = grads.scalar_type() == at::kFloat ||
                               (!weight.is_cuda() && grads.scalar_type() == at::kBFloat16);
    TORCH_CHECK(!a.has_grad || (grads.dim() == 2 && grads.size(0) == R && grads.size(1) == weight.size(1) &&
                                grad_dtype_ok && grads.is_contiguous()),
                "row_update: grads must be contiguous fp32 [len(slots), dim] (bf16 too on the CPU)");
    TORCH_CHECK(a.lazy || (last_step.numel() == R && last_step.scalar_type() == at::kLong),
                "row_update: exact mode needs last_step (int64, one per row)");
    TORCH_CHECK(a.lazy || (lr_hist.scalar_type() == at::kDouble && wd_hist.scalar_type() == at::kDouble &&
                           lr_hist.numel() > a.step - (a.has_grad ? 1 : 0) &&
                           wd_hist.numel() == lr_hist.numel()),
                "row_update: exact mode needs float64 lr/wd histories covering every replayed step");
}

}  // namespace maximus
