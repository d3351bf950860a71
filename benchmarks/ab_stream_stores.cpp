// A/B of the CPU op's bf16 copy written with ordinary stores or with streaming stores
// (csrc/row_ops/cpu/bf16_copy.h, the op's own code), after an AdamW-like update of the same row
// (the fused step's pass). Both variants run in one process, interleaved 12 times each, so that the
// host's drift (a shared 2-core VM moved ~30% between separate runs of bench_cpu_optimizer) falls on both.
//
//     g++ -O3 -march=native -fopenmp -fno-math-errno benchmarks/ab_stream_stores.cpp -o /tmp/ab && /tmp/ab
//
// 64M elements: per element the pass reads p, m, v (fp32) and a bf16 gradient and writes p, m, v and the
// bf16 copy: ~30 bytes, 2 of them the read of each copy line that an ordinary store does first.
// Needs AVX2 (as the op's streaming path does). On the 2-core CI-like VM, 2026-11-30, 16 runs: streaming
// stores took 2-10% less time in 15 (-0.8% in one), median 5.6%.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "../csrc/row_ops/cpu/bf16_copy.h"

namespace {

void update(float* p, float* m, float* v, const uint16_t* g, int64_t d) {
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) {
        const uint32_t b = uint32_t(g[j]) << 16;
        float gf;
        std::memcpy(&gf, &b, sizeof(gf));
        m[j] = 0.9f * m[j] + 0.1f * gf;
        v[j] = 0.999f * v[j] + 0.001f * gf * gf;
        p[j] -= 1e-3f * m[j] / (__builtin_sqrtf(v[j]) + 1e-8f);
    }
}

}  // namespace

int main() {
    const int64_t n = 64ll << 20, d = 4096, rows = n / d, rounds = 12;
    std::vector<float> p(n), m(n, 0.f), v(n, 0.f);
    std::vector<uint16_t> g(n, 0x3F80), copy(n);
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(i) * 1e-7f;
    std::vector<double> ms[2] = {std::vector<double>(rounds), std::vector<double>(rounds)};
    for (int64_t it = 0; it < rounds; ++it) {
        for (int k = 0; k < 2; ++k) {
            const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(static)
            for (int64_t r = 0; r < rows; ++r) {
                update(&p[r * d], &m[r * d], &v[r * d], &g[r * d], d);
                (k == 0 ? maximus::bf16_copy_plain : maximus::bf16_copy)(&copy[r * d], &p[r * d], d);
            }
            ms[k][it] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3;
        }
    }
    for (auto& t : ms) std::sort(t.begin(), t.end());
    std::printf("update + bf16 copy, %lld elements, %d threads, median of %lld: ordinary stores %.2f ms, "
                "streaming stores %.2f ms (%.1f%% less)\n", static_cast<long long>(n), omp_get_max_threads(),
                static_cast<long long>(rounds), ms[0][rounds / 2], ms[1][rounds / 2],
                100.0 * (1.0 - ms[1][rounds / 2] / ms[0][rounds / 2]));
    return 0;
}
