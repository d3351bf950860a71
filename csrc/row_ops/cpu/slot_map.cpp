// SlotMap.assign (ds_maximus/partition/policy.py) in one host call: the id -> slot map of a partition cache is
// decided on the host every step, and as ~35 small torch ops it cost ~1 ms of host time per step at a
// 262K-row vocabulary with a 26K-slot cache. The Python method is the reference (and the fallback).
#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "row_ops/row_ops.h"

namespace maximus {

std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> slot_assign_cpu(
    const at::Tensor& ids, at::Tensor& id_to_slot, at::Tensor& slot_to_id, at::Tensor& last_use,
    at::Tensor& slot_freq, at::Tensor& id_freq, const at::Tensor& pin_count, double clock, bool lfu) {
    auto cpu_long = [](const at::Tensor& t) {
        return !t.is_cuda() && t.scalar_type() == at::kLong && t.is_contiguous();
    };
    TORCH_CHECK(cpu_long(ids) && cpu_long(id_to_slot) && cpu_long(slot_to_id),
                "slot_assign: ids and the maps must be contiguous int64 CPU tensors");
    TORCH_CHECK(last_use.scalar_type() == at::kDouble && last_use.is_contiguous() && !last_use.is_cuda() &&
                    last_use.numel() == slot_to_id.numel(),
                "slot_assign: last_use must be float64, one per slot");
    TORCH_CHECK(pin_count.scalar_type() == at::kInt && pin_count.is_contiguous() &&
                    pin_count.numel() == slot_to_id.numel(),
                "slot_assign: pin_count must be int32, one per slot");
    TORCH_CHECK(!lfu || (slot_freq.scalar_type() == at::kDouble && id_freq.scalar_type() == at::kDouble &&
                         slot_freq.numel() == slot_to_id.numel() && id_freq.numel() == id_to_slot.numel()),
                "slot_assign: LFU needs float64 slot_freq (per slot) and id_freq (per id)");
    const int64_t U = ids.numel(), S = slot_to_id.numel(), V = id_to_slot.numel();
    const int64_t* id = ids.data_ptr<int64_t>();
    int64_t* i2s = id_to_slot.data_ptr<int64_t>();
    int64_t* s2i = slot_to_id.data_ptr<int64_t>();
    double* lu = last_use.data_ptr<double>();
    const int32_t* pin = pin_count.data_ptr<int32_t>();
    double* sf = lfu ? slot_freq.data_ptr<double>() : nullptr;
    double* idf = lfu ? id_freq.data_ptr<double>() : nullptr;
    for (int64_t u = 0; u < U; ++u) TORCH_CHECK(id[u] >= 0 && id[u] < V, "slot_assign: id ", id[u], " out of range");

    const auto opts = ids.options();
    at::Tensor slots = at::empty({U}, opts);
    int64_t* sl = slots.data_ptr<int64_t>();
    // kept between calls (one per thread): a fresh 26K-slot candidate list is a page-faulting allocation.
    // Bound to locals once: each use of a thread_local in a shared library is a __tls_get_addr call, and in
    // the loops below those calls (and the spills around them) were a third of this function's time.
    thread_local std::vector<int64_t> miss_pos_tls;
    thread_local std::vector<uint8_t> hit_tls;
    thread_local std::vector<std::pair<double, int64_t>> cand_tls;
    thread_local std::vector<double> smp_tls;
    std::vector<int64_t>& miss_pos = miss_pos_tls;
    std::vector<std::pair<double, int64_t>>& cand = cand_tls;
    miss_pos.clear();
    hit_tls.assign(S, 0);
    uint8_t* const hit = hit_tls.data();
    for (int64_t u = 0; u < U; ++u) {
        const int64_t slot = i2s[id[u]];
        sl[u] = slot;
        if (slot < 0)
            miss_pos.push_back(u);
        else
            hit[slot] = 1;
    }
    const int64_t M = (int64_t)miss_pos.size();
    at::Tensor victims = at::empty({M}, opts), ev_ids, ev_slots;
    if (M > S) return {1, slots, at::empty({0}, opts), victims, at::empty({0}, opts), at::empty({0}, opts)};
    if (M) {
        // free slots first (score -1), then the lowest LRU/LFU score; pinned slots and this batch's hits never;
        // ties by slot number, so the result does not depend on the selection algorithm.
        // A score bound from a strided sample of the slots: its q-th lowest score, q sized so that (with room
        // to spare) at least M eligible slots score no higher. The pass then keeps only those slots, not all
        // ~S (at 26K slots that list and its selection were most of this call). Too few kept: no bound.
        auto score = [s2i, sf, lu, lfu](int64_t s) {
            return s2i[s] < 0 ? -1.0 : (lfu ? sf[s] * 1e9 + lu[s] : lu[s]);
        };
        constexpr double kNone = std::numeric_limits<double>::infinity();
        double bound = kNone;
        constexpr int64_t kSample = 1024;
        if (M * 4 < S && S >= 4 * kSample) {
            std::vector<double>& smp = smp_tls;
            smp.clear();
            for (int64_t k = 0, step = S / kSample; k < kSample; ++k) {
                const int64_t s = k * step + step / 2;
                if (!hit[s] && pin[s] <= 0) smp.push_back(score(s));
            }
            const int64_t q = (M * kSample * 3) / (2 * S) + 16;  // 1.5x the expected rank, and 16 more
            if (q < (int64_t)smp.size()) {
                std::nth_element(smp.begin(), smp.begin() + q, smp.end());
                bound = smp[q];
            }
        }
        for (;;) {
            cand.clear();
            for (int64_t s = 0; s < S; ++s) {
                if (hit[s] | (pin[s] > 0)) continue;
                const double sc = score(s);
                if (sc <= bound) cand.emplace_back(sc, s);
            }
            if ((int64_t)cand.size() >= M || bound == kNone) break;
            bound = kNone;  // the sample misjudged: every eligible slot
        }
        if ((int64_t)cand.size() < M)
            return {2, slots, at::empty({0}, opts), victims, at::empty({0}, opts), at::empty({0}, opts)};
        std::nth_element(cand.begin(), cand.begin() + (M - 1), cand.end());
        int64_t* vic = victims.data_ptr<int64_t>();
        for (int64_t i = 0; i < M; ++i) vic[i] = cand[i].second;
        std::sort(vic, vic + M);  // the i-th miss goes to the i-th lowest victim slot
        std::vector<int64_t> eid, eslot;
        for (int64_t i = 0; i < M; ++i) {
            const int64_t v = vic[i], old = s2i[v];
            if (old >= 0) {
                eid.push_back(old);
                eslot.push_back(v);
                i2s[old] = -1;
            }
        }
        for (int64_t i = 0; i < M; ++i) {
            const int64_t v = vic[i], mid = id[miss_pos[i]];
            s2i[v] = mid;
            i2s[mid] = v;
            sl[miss_pos[i]] = v;
        }
        ev_ids = at::empty({(int64_t)eid.size()}, opts);
        ev_slots = at::empty({(int64_t)eslot.size()}, opts);
        std::copy(eid.begin(), eid.end(), ev_ids.data_ptr<int64_t>());
        std::copy(eslot.begin(), eslot.end(), ev_slots.data_ptr<int64_t>());
    } else {
        ev_ids = at::empty({0}, opts);
        ev_slots = at::empty({0}, opts);
    }
    at::Tensor miss = at::empty({M}, opts);
    std::copy(miss_pos.begin(), miss_pos.end(), miss.data_ptr<int64_t>());
    for (int64_t u = 0; u < U; ++u) {  // touch: recency, and frequency for LFU
        lu[sl[u]] = clock;
        if (lfu) {
            idf[id[u]] += 1.0;
            sf[sl[u]] = idf[id[u]];
        }
    }
    return {0, slots, miss, victims, ev_ids, ev_slots};
}

}  // namespace maximus
