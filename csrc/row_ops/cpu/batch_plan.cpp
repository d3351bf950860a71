// BatchPlanner.plan (ds_maximus/vocab/function.py) in one host call: the sorted unique ids of a batch,
// each token's index into them, the token positions sorted stably by id, and the segment starts. The lookup
// and the prefetch plan every batch on the host; in numpy this took ~0.5 ms a step for 16K tokens over a
// 262K vocabulary (a mask scan, a rank table, a radix argsort, a bincount), here a few linear passes.
#include <algorithm>
#include <cstring>
#include <vector>

#include "row_ops/row_ops.h"

namespace maximus {

int64_t batch_plan_cpu(const at::Tensor& ids, at::Tensor& mask, at::Tensor& rank, at::Tensor& uniq_out,
                       at::Tensor& idx_out) {
    auto host_long = [](const at::Tensor& t) {
        return !t.is_cuda() && t.scalar_type() == at::kLong && t.is_contiguous();
    };
    TORCH_CHECK(host_long(ids) && host_long(rank) && host_long(uniq_out) && host_long(idx_out),
                "batch_plan: ids, rank and the outputs must be contiguous int64 CPU tensors");
    TORCH_CHECK(!mask.is_cuda() && mask.scalar_type() == at::kBool && mask.is_contiguous() &&
                    mask.numel() == rank.numel(),
                "batch_plan: mask must be a contiguous bool CPU tensor, one per vocabulary id like rank");
    const int64_t N = ids.numel(), V = mask.numel();
    TORCH_CHECK(uniq_out.numel() >= N && idx_out.numel() >= 3 * N + 1,
                "batch_plan: uniq_out needs N entries and idx_out 3N + 1");
    const int64_t* id = ids.data_ptr<int64_t>();
    // an id outside the vocabulary: -1 - its position, nothing written (the caller raises the IndexError; no
    // exception is thrown here, where the GIL is released)
    for (int64_t n = 0; n < N; ++n)
        if (id[n] < 0 || id[n] >= V) return -1 - n;
    uint8_t* mk = reinterpret_cast<uint8_t*>(mask.data_ptr<bool>());  // all 0 between calls
    int64_t* rk = rank.data_ptr<int64_t>();
    int64_t* uq = uniq_out.data_ptr<int64_t>();
    int64_t* inv = idx_out.data_ptr<int64_t>();
    int64_t* order = inv + N;
    int64_t* off = inv + 2 * N;  // U + 1 entries

    for (int64_t n = 0; n < N; ++n) mk[id[n]] = 1;
    // the unique ids in order: scan the mask eight bytes at a time, clearing it for the next call
    int64_t U = 0, v = 0;
    for (; v + 8 <= V; v += 8) {
        uint64_t word;
        std::memcpy(&word, mk + v, 8);
        if (!word) continue;
        for (int b = 0; b < 8; ++b)
            if (mk[v + b]) uq[U++] = v + b;
        std::memset(mk + v, 0, 8);
    }
    for (; v < V; ++v)
        if (mk[v]) {
            uq[U++] = v;
            mk[v] = 0;
        }
    for (int64_t u = 0; u < U; ++u) rk[uq[u]] = u;
    // inverse and segment sizes, then a stable counting sort of the token positions by id
    std::fill(off, off + U + 1, 0);
    for (int64_t n = 0; n < N; ++n) {
        inv[n] = rk[id[n]];
        ++off[inv[n] + 1];
    }
    for (int64_t u = 0; u < U; ++u) off[u + 1] += off[u];
    thread_local std::vector<int64_t> next_tls;  // bound once: a thread_local use is a __tls_get_addr call
    next_tls.assign(off, off + U);
    int64_t* const next = next_tls.data();
    for (int64_t n = 0; n < N; ++n) order[next[inv[n]]++] = n;
    return U;
}

}  // namespace maximus
