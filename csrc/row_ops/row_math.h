// Element-wise optimizer math shared by the CPU and CUDA kernels of maximus_row_ops.
// No torch headers. Scalars are formed in double and rounded to float, element math is float,
// in the operation order of torch.optim (foreach=False), so results track torch within rounding.
// Every multiply-add is an explicit fmaf and no other product meets an addition (the CPU op is built with
// -ffp-contract=off, and mul_rn keeps nvcc from fusing the products that meet one), so no
// compiler has a contraction left to choose: with IEEE division and square root on both (the CUDA op is
// built without --use_fast_math), the CPU and CUDA ops give the same bits, and an expert or row gets the same update
// whichever side of a split step takes it (they differed in the last bits of v before, fused differently
// by GCC and nvcc). One exception, for speed: the CUDA op replays skipped steps (exact mode) with the
// GPU's approximate division and square root (``ApproxMath``), as the fast-math build did; a Zipf tail row
// replays hundreds of steps per element (with IEEE ones the benchmark's exact-mode step took 6.25 ms
// instead of 3.72). Replays stay within the tolerance tests give dense AdamW; the MoE trainer replays on
// the CPU tier only (at routing), so its split step's two sides never replay.
#pragma once
#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define MAXIMUS_HD __host__ __device__ __forceinline__
#else
#define MAXIMUS_HD inline
#endif

namespace maximus {

enum OptimizerCode : int { kAdamW = 0, kAdagrad = 1 };

// Division and square root of the element math: IEEE (correctly rounded) everywhere by default.
struct IeeeMath {
    static MAXIMUS_HD float div(float a, float b) { return a / b; }
    static MAXIMUS_HD float sqrt(float x) { return sqrtf(x); }
};

// The GPU's approximate instructions in device code (IEEE on the host): for replayed steps only.
struct ApproxMath {
    static MAXIMUS_HD float div(float a, float b) {
#ifdef __CUDA_ARCH__
        return __fdividef(a, b);
#else
        return a / b;
#endif
    }
    static MAXIMUS_HD float sqrt(float x) {
#ifdef __CUDA_ARCH__
        float r;
        asm("sqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
        return r;
#else
        return sqrtf(x);
#endif
    }
};

struct StepCoeffs {
    float decay;     // 1 - lr * wd (AdamW, SparseAdam: decoupled)  |  wd (Adagrad: L2)
    float w1;        // 1 - beta1
    float b2;        // beta2
    float w2;        // 1 - beta2
    float bc2_sqrt;  // sqrt(1 - beta2^k)
    float eps;
    float neg_step;  // -lr / (1 - beta1^k)  (AdamW) | -lr sqrt(bc2) / bc1 (SparseAdam) | -lr (Adagrad)
    int has_wd;
};

// a * b rounded, never fused into an addition by the compiler (nvcc contracts device code by default; the CPU
// op is built with -ffp-contract=off): 1 - lr * wd as torch computes it, and the same on both sides.
MAXIMUS_HD double mul_rn(double a, double b) {
#ifdef __CUDA_ARCH__
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}

// The same for a float product that meets an addition (SparseAdam's m0 + (g - m0) * w1, as torch orders it).
MAXIMUS_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

// torch.optim.AdamW at step k (lazy: torch.optim.SparseAdam, Adagrad: torch.optim.Adagrad, lr_decay 0).
MAXIMUS_HD StepCoeffs step_coeffs(int opt, bool lazy, double lr, double wd, double beta1, double beta2,
                                  double eps, int64_t k) {
    StepCoeffs c;
    c.has_wd = wd != 0.0;
    c.w1 = (float)(1.0 - beta1);
    c.b2 = (float)beta2;
    c.w2 = (float)(1.0 - beta2);
    c.eps = (float)eps;
    double bc1 = 1.0 - pow(beta1, (double)k);
    double bc2 = 1.0 - pow(beta2, (double)k);
    c.bc2_sqrt = (float)pow(bc2, 0.5);
    if (opt == kAdagrad) {
        c.decay = (float)wd;
        c.neg_step = (float)(-lr);
    } else if (lazy) {
        c.decay = (float)(1.0 - mul_rn(lr, wd));
        c.neg_step = (float)(-(lr * sqrt(bc2) / bc1));
    } else {
        c.decay = (float)(1.0 - mul_rn(lr, wd));
        c.neg_step = (float)(-(lr / bc1));
    }
    return c;
}

// One AdamW step on one element; g is 0 for a replayed (untouched) step.
template <class M = IeeeMath>
MAXIMUS_HD void adamw_elem(float& p, float& m, float& v, float g, const StepCoeffs& c) {
    if (c.has_wd) p = p * c.decay;
    m = fmaf(c.w1, g - m, m);
    v = fmaf(v, c.b2, (c.w2 * g) * g);
    const float denom = M::div(M::sqrt(v), c.bc2_sqrt) + c.eps;
    p = fmaf(c.neg_step, M::div(m, denom), p);
}

// One SparseAdam step (plus optional decoupled decay) on one touched element.
template <class M = IeeeMath>
MAXIMUS_HD void sparse_adam_elem(float& p, float& m, float& v, float g, const StepCoeffs& c) {
    if (c.has_wd) p = p * c.decay;
    const float m0 = m, v0 = v;
    const float um = mul_rn(g - m0, c.w1);
    const float uv = mul_rn(fmaf(g, g, -v0), c.w2);
    m = m0 + um;
    v = v0 + uv;
    const float denom = M::sqrt(uv + v0) + c.eps;
    p = fmaf(c.neg_step, M::div(um + m0, denom), p);
}

// One Adagrad step (L2 weight decay folded into the gradient).
template <class M = IeeeMath>
MAXIMUS_HD void adagrad_elem(float& p, float& s, float g, const StepCoeffs& c) {
    if (c.has_wd) g = fmaf(c.decay, p, g);
    s = fmaf(g, g, s);
    const float std_ = M::sqrt(s) + c.eps;
    p = fmaf(c.neg_step, M::div(g, std_), p);
}

template <class M = IeeeMath>
MAXIMUS_HD void update_elem(int opt, bool lazy, float& p, float& s0, float* s1, float g, const StepCoeffs& c) {
    if (opt == kAdagrad) {
        adagrad_elem<M>(p, s0, g, c);
    } else if (lazy) {
        sparse_adam_elem<M>(p, s0, *s1, g, c);
    } else {
        adamw_elem<M>(p, s0, *s1, g, c);
    }
}

// A replayed zero-gradient step changes nothing for Adagrad without weight decay.
MAXIMUS_HD bool replay_is_noop(int opt, double wd) { return opt == kAdagrad && wd == 0.0; }

}  // namespace maximus
