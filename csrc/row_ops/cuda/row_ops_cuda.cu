// CUDA kernels of maximus_row_ops. All run on the current stream; no host syncs.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "row_ops/row_math.h"
#include "row_ops/row_ops.h"

namespace maximus {

namespace {

constexpr int kThreads = 256;

inline int grid_for(int64_t n) { return (int)std::max<int64_t>(1, std::min<int64_t>(n, 65535 * 8)); }

// One block per output row: out[n, :] = table[slots[inverse[n]], :]; float4 loads when d % 4 == 0.
template <typename T, bool kVec>
__global__ void gather_kernel(const float* __restrict__ table, const int64_t* __restrict__ slots,
                              const int64_t* __restrict__ inverse, T* __restrict__ out, int64_t N, int64_t d) {
    for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
        const float* src = table + slots[inverse[n]] * d;
        T* dst = out + n * d;
        if (kVec) {
            const float4* src4 = reinterpret_cast<const float4*>(src);
            for (int64_t j = threadIdx.x; j < d / 4; j += blockDim.x) {
                const float4 x = src4[j];
                dst[4 * j + 0] = static_cast<T>(x.x);
                dst[4 * j + 1] = static_cast<T>(x.y);
                dst[4 * j + 2] = static_cast<T>(x.z);
                dst[4 * j + 3] = static_cast<T>(x.w);
            }
        } else {
            for (int64_t j = threadIdx.x; j < d; j += blockDim.x) dst[j] = static_cast<T>(src[j]);
        }
    }
}

// Blocks over (unique ids, column tiles); each thread sums one column over the id's tokens in token
// order (deterministic, same order as the CPU kernel and the reference). A frequent id (thousands of
// tokens under Zipf) is spread over d / blockDim column tiles, and its token loop issues kUnroll loads
// ahead of the in-order additions, so one hot id does not serialise the kernel.
template <typename T>
__global__ void segment_reduce_kernel(const T* __restrict__ grad, const int64_t* __restrict__ order,
                                      const int64_t* __restrict__ offsets, float* __restrict__ out, int64_t U,
                                      int64_t d) {
    // 32 loads in flight a thread: a Zipf batch's most frequent id has ~2,000 of 16K tokens, and its one
    // block per column tile is bound by memory latency (8 in flight made it a visible part of a step)
    constexpr int kUnroll = 32;
    const int64_t j = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= d) return;
    for (int64_t u = blockIdx.x; u < U; u += gridDim.x) {
        const int64_t lo = offsets[u], hi = offsets[u + 1];
        float acc = 0.f;
        int64_t i = lo;
        for (; i + kUnroll <= hi; i += kUnroll) {
            float g[kUnroll];
#pragma unroll
            for (int k = 0; k < kUnroll; ++k) g[k] = static_cast<float>(grad[order[i + k] * d + j]);
#pragma unroll
            for (int k = 0; k < kUnroll; ++k) acc += g[k];
        }
        for (; i + 4 <= hi; i += 4) {
            float g[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) g[k] = static_cast<float>(grad[order[i + k] * d + j]);
#pragma unroll
            for (int k = 0; k < 4; ++k) acc += g[k];
        }
        for (; i < hi; ++i) acc += static_cast<float>(grad[order[i] * d + j]);
        out[u * d + j] = acc;
    }
}

// One block per row: replay the skipped steps (exact mode), then the gradient step.
// The replay takes the skipped steps kThreads at a time: each thread computes one step's coefficients
// into shared memory (double pow, in parallel), then each thread carries its elements through the whole
// chunk in registers. Memory traffic is one read and write of the row per chunk, not per skipped step,
// and the per-element arithmetic is the same sequence as one step at a time (identical results). Replays use
// the approximate division and square root (row_math.h: ApproxMath); the gradient's step is IEEE, as on the CPU.
__global__ void row_update_kernel(float* __restrict__ W, float* __restrict__ S0, float* __restrict__ S1,
                                  const int64_t* __restrict__ slots, const float* __restrict__ G,
                                  const int64_t* __restrict__ last, const double* __restrict__ lrh,
                                  const double* __restrict__ wdh, int64_t R, int64_t d, RowUpdateArgs a) {
    __shared__ StepCoeffs sc[kThreads];
    __shared__ int live[kThreads];  // index into sc of the chunk's steps that are not no-ops
    __shared__ int n_live;
    const StepCoeffs gc = step_coeffs(a.optimizer, a.lazy, a.lr, a.weight_decay, a.beta1, a.beta2, a.eps, a.step);
    for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
        const int64_t s = slots[r];
        float* p = W + s * d;
        float* m = S0 + s * d;
        float* v = S1 ? S1 + s * d : nullptr;
        if (!a.lazy) {
            const int64_t end = a.has_grad ? a.step - 1 : a.step;
            for (int64_t k0 = last[r] + 1; k0 <= end; k0 += kThreads) {
                const int n = (int)(end - k0 + 1 < kThreads ? end - k0 + 1 : kThreads);
                __syncthreads();  // the previous chunk (or row) is done with sc
                if (threadIdx.x < n) {
                    const int64_t k = k0 + threadIdx.x;
                    sc[threadIdx.x] = step_coeffs(a.optimizer, false, lrh[k], wdh[k], a.beta1, a.beta2, a.eps, k);
                }
                if (threadIdx.x == 0) {  // keep step order; drop no-op replays
                    int c = 0;
                    for (int i = 0; i < n; ++i)
                        if (!replay_is_noop(a.optimizer, wdh[k0 + i])) live[c++] = i;
                    n_live = c;
                }
                __syncthreads();
                const int nl = n_live;
                for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
                    float pj = p[j], mj = m[j], vj = v ? v[j] : 0.f;
                    for (int i = 0; i < nl; ++i)
                        update_elem<ApproxMath>(a.optimizer, false, pj, mj, &vj, 0.f, sc[live[i]]);
                    p[j] = pj;
                    m[j] = mj;
                    if (v) v[j] = vj;
                }
            }
        }
        if (G) {
            const float* g = G + r * d;
            float dummy = 0.f;
            for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
                update_elem(a.optimizer, a.lazy, p[j], m[j], v ? v + j : &dummy, g[j], gc);
        }
    }
}

// dst[dst_idx[r], :] = src[src_idx[r], :]; either side may be pinned host memory (read/written over PCIe
// through its mapped device address), so a cache fill or write-back is one kernel with no host copy.
// The grid is capped (copy_blocks): a PCIe-bound copy on every SM would hold the SMs for its whole run, and
// the compute stream's kernels would queue behind its blocks (small kernels then take many times longer
// beside a fill; docs/bench/code_history.md). Each thread keeps kUnroll 16-byte loads in flight, so a few dozen blocks fill the link.
constexpr int kUnroll = 4;
__global__ void copy_rows_kernel(const float* __restrict__ src, const int64_t* __restrict__ src_idx,
                                 float* __restrict__ dst, const int64_t* __restrict__ dst_idx, int64_t R, int64_t d) {
    for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
        const float* a = src + src_idx[r] * d;
        float* b = dst + dst_idx[r] * d;
        if (d % 4 == 0) {
            const float4* a4 = reinterpret_cast<const float4*>(a);
            float4* b4 = reinterpret_cast<float4*>(b);
            const int64_t n4 = d / 4;
            for (int64_t j0 = threadIdx.x; j0 < n4; j0 += (int64_t)blockDim.x * kUnroll) {
                float4 buf[kUnroll];
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int64_t j = j0 + (int64_t)u * blockDim.x;
                    if (j < n4) buf[u] = a4[j];
                }
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int64_t j = j0 + (int64_t)u * blockDim.x;
                    if (j < n4) b4[j] = buf[u];
                }
            }
        } else {
            for (int64_t j = threadIdx.x; j < d; j += blockDim.x) b[j] = a[j];
        }
    }
}

// Blocks of one copy_rows launch: max_blocks when given, else a quarter of the SMs (at least 8).
int copy_blocks(int64_t R, int64_t max_blocks) {
    if (max_blocks <= 0) {
        int dev = 0, sms = 0;
        C10_CUDA_CHECK(cudaGetDevice(&dev));
        C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
        max_blocks = std::max(8, sms / 4);
    }
    return (int)std::max<int64_t>(1, std::min<int64_t>(R, max_blocks));
}

float* device_address(const at::Tensor& t, const char* what) {
    if (t.is_cuda()) return t.data_ptr<float>();
    void* dptr = nullptr;
    const cudaError_t err = cudaHostGetDevicePointer(&dptr, t.data_ptr(), 0);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        TORCH_CHECK(false, "copy_rows: ", what, " is a CPU tensor that is not pinned (mapped) memory: ",
                    cudaGetErrorString(err), "; pin it (tensor.pin_memory()) or copy through a staging buffer");
    }
    return static_cast<float*>(dptr);
}

}  // namespace

void copy_rows_cuda(const at::Tensor& src, const at::Tensor& src_idx, at::Tensor& dst, const at::Tensor& dst_idx,
                    int64_t max_blocks) {
    TORCH_CHECK(src.scalar_type() == at::kFloat && dst.scalar_type() == at::kFloat && src.is_contiguous() &&
                    dst.is_contiguous() && src.dim() == 2 && dst.dim() == 2 && src.size(1) == dst.size(1),
                "copy_rows: src and dst must be contiguous fp32 [rows, dim] tensors of one dim");
    TORCH_CHECK(src_idx.is_cuda() && dst_idx.is_cuda() && src_idx.numel() == dst_idx.numel() &&
                    src_idx.scalar_type() == at::kLong && dst_idx.scalar_type() == at::kLong,
                "copy_rows: indices must be int64 GPU tensors of equal length");
    const c10::cuda::CUDAGuard guard(src_idx.device());
    const int64_t R = src_idx.numel(), d = src.size(1);
    if (R == 0) return;
    const float* a = device_address(src, "src");
    float* b = device_address(dst, "dst");
    const bool aligned = reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0;
    TORCH_CHECK(aligned || d % 4 != 0, "copy_rows: tables must be 16-byte aligned");
    auto si = src_idx.contiguous();
    auto di = dst_idx.contiguous();
    copy_rows_kernel<<<copy_blocks(R, max_blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        a, si.data_ptr<int64_t>(), b, di.data_ptr<int64_t>(), R, d);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void gather_cuda(const at::Tensor& table, const at::Tensor& slots, const at::Tensor& inverse, at::Tensor& out) {
    TORCH_CHECK(table.is_cuda() && slots.is_cuda() && inverse.is_cuda() && out.is_cuda(),
                "gather: all tensors must be on the GPU");
    TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() && table.dim() == 2,
                "gather: table must be contiguous fp32 [rows, dim]");
    TORCH_CHECK(out.is_contiguous() && out.size(0) == inverse.numel() && out.size(1) == table.size(1),
                "gather: out must be contiguous [len(inverse), dim]");
    const c10::cuda::CUDAGuard guard(table.device());
    auto sl = slots.contiguous();
    auto inv = inverse.contiguous();
    const int64_t N = inv.numel(), d = table.size(1);
    if (N == 0) return;
    auto stream = c10::cuda::getCurrentCUDAStream();
    const bool vec = d % 4 == 0 && reinterpret_cast<uintptr_t>(table.data_ptr()) % 16 == 0;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "maximus_gather_cuda", [&] {
        if (vec)
            gather_kernel<scalar_t, true><<<grid_for(N), kThreads, 0, stream>>>(
                table.data_ptr<float>(), sl.data_ptr<int64_t>(), inv.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), N, d);
        else
            gather_kernel<scalar_t, false><<<grid_for(N), kThreads, 0, stream>>>(
                table.data_ptr<float>(), sl.data_ptr<int64_t>(), inv.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), N, d);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void segment_reduce_cuda(const at::Tensor& grad, const at::Tensor& order, const at::Tensor& offsets, at::Tensor& out) {
    TORCH_CHECK(grad.is_cuda() && order.is_cuda() && offsets.is_cuda() && out.is_cuda(),
                "segment_reduce: all tensors must be on the GPU");
    TORCH_CHECK(grad.dim() == 2 && grad.is_contiguous(), "segment_reduce: grad must be contiguous [N, dim]");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(1) == grad.size(1) &&
                    offsets.numel() == out.size(0) + 1,
                "segment_reduce: out must be contiguous fp32 [U, dim] and offsets [U + 1]");
    const c10::cuda::CUDAGuard guard(grad.device());
    const int64_t U = out.size(0), d = grad.size(1);
    if (U == 0) return;
    auto stream = c10::cuda::getCurrentCUDAStream();
    auto ord = order.contiguous();
    auto off = offsets.contiguous();
    const int64_t tiles = (d + kThreads - 1) / kThreads;
    TORCH_CHECK(tiles <= 65535, "segment_reduce: embedding_dim ", d, " is too large");
    const dim3 grid((unsigned)std::min<int64_t>(U, 65535), (unsigned)tiles);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "maximus_segment_reduce_cuda", [&] {
        segment_reduce_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
            grad.data_ptr<scalar_t>(), ord.data_ptr<int64_t>(), off.data_ptr<int64_t>(), out.data_ptr<float>(), U, d);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void row_update_cuda(at::Tensor& weight, at::Tensor& s0, at::Tensor& s1, const at::Tensor& slots,
                     const at::Tensor& grads, const at::Tensor& last_step, const at::Tensor& lr_hist,
                     const at::Tensor& wd_hist, const RowUpdateArgs& a) {
    check_update_args(weight, s0, s1, slots, grads, last_step, lr_hist, wd_hist, a);
    TORCH_CHECK(weight.is_cuda() && slots.is_cuda() && (!a.has_grad || grads.is_cuda()) &&
                    (a.lazy || (last_step.is_cuda() && lr_hist.is_cuda() && wd_hist.is_cuda())),
                "row_update: all tensors must be on the GPU");
    const c10::cuda::CUDAGuard guard(weight.device());
    const int64_t R = slots.numel(), d = weight.size(1);
    if (R == 0) return;
    auto stream = c10::cuda::getCurrentCUDAStream();
    row_update_kernel<<<grid_for(R), kThreads, 0, stream>>>(
        weight.data_ptr<float>(), s0.data_ptr<float>(), a.optimizer == kAdagrad ? nullptr : s1.data_ptr<float>(),
        slots.data_ptr<int64_t>(), a.has_grad ? grads.data_ptr<float>() : nullptr,
        a.lazy ? nullptr : last_step.data_ptr<int64_t>(), a.lazy ? nullptr : lr_hist.data_ptr<double>(),
        a.lazy ? nullptr : wd_hist.data_ptr<double>(), R, d, a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace maximus
