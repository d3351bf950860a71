"""The same equalities on a CUDA device: side-stream loads, events, bf16. Skips without a GPU."""
import random

import pytest
import torch

from ds_maximus.config import CachePolicy
from ds_maximus.experts import offload_experts
from ds_maximus.experts.expert_cache import ExpertCache
from ds_maximus.experts.expert_store import CpuExpertStore
from ds_maximus.experts.layout import ExpertLayout

from .tiny_moe import clone, tiny_model

pytestmark = pytest.mark.gpu


def generate_offloaded_cuda(kind, impl, config, seed):
    """Greedy 32 tokens of a bf16 tiny ``kind`` on CUDA, plain and through ``offload_experts(config)``: asserts the
    tokens and logits equal, returns the offload's stats."""
    model = tiny_model(kind, impl, top_k=2, dtype=torch.bfloat16).cuda()
    ref = clone(model)
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(seed)).cuda()
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, return_dict_in_generate=True,
              output_logits=True, pad_token_id=0)
    a = ref.generate(ids, **kw)
    h = offload_experts(model, config)
    b = model.generate(ids, **kw)
    st = h.stats()
    h.close()
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(b.logits), torch.stack(a.logits), rtol=0, atol=0)
    return st


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("impl", ["grouped_mm", "eager", "batched_mm"])
@pytest.mark.parametrize("slots", [1, 3, 8])
def test_generate_identical_cuda(kind, impl, slots):
    st = generate_offloaded_cuda(kind, impl, {"gpu_experts_per_layer": slots}, seed=3)
    assert st["bytes_moved"] > 0


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_skip_resident_guesses_cuda(kind):
    """moe.prefetch_skip_resident on CUDA: the staged guesses past resident experts (and the events of resident
    experts skipped once landed) change no token or logit."""
    st = generate_offloaded_cuda(kind, "eager", {"gpu_experts_per_layer": 3, "prefetch_skip_resident": True}, seed=5)
    assert st["prefetch_useful"] > 0


@pytest.mark.parametrize("impl", ["grouped_mm", "eager", "batched_mm"])
def test_expert_compute_never_waits_on_the_host(impl):
    """The layer's expert GEMMs are queued behind their loads without a host sync (the one sync per
    layer is the routing's ``tolist``): CUDA's sync debug mode raises on any synchronising call."""
    from ds_maximus.experts import compute
    model = tiny_model("mixtral", impl, top_k=2, dtype=torch.bfloat16).cuda()
    h = offload_experts(model, {"gpu_experts_per_layer": 2, "speculative_prefetch": False})
    mod = h.modules[0]
    x = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
    idx = torch.tensor([[0, 3], [3, 5], [1, 0], [7, 2], [5, 3]], device="cuda")
    w = torch.softmax(torch.randn(5, 2, device="cuda"), -1).to(torch.bfloat16)
    pairs = idx.flatten().tolist()
    used = sorted(set(pairs))
    counts = [pairs.count(e) for e in range(8)]
    fn = {"grouped_mm": lambda c: compute.grouped_forward(c, x, idx, w, used, counts),
          "eager": lambda c: compute.eager_forward(c, x, idx, w, used, pairs),
          "batched_mm": lambda c: compute.batched_forward(c, x, idx, w, used, pairs)}[impl]
    ctx = lambda: compute.ExpertComputeContext(h.cache, 0, mod._original._apply_gate, 8)  # noqa: E731
    ref = fn(ctx())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fn(ctx())   # 3 rounds of 2 slots: loads, evictions, GEMMs
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out, ref)
    h.close()


@pytest.mark.parametrize("chunk_bytes,stage", [(None, False), (64 << 10, False), (64 << 10, True)])
def test_cuda_churn_contents(chunk_bytes, stage):
    """Random demand and guesses (whole, or a head chunk of 1/8, into the slot or staged, that the next
    acquire drops or completes) on the side stream."""
    E, G, slots = 6, 3, 2
    lay = ExpertLayout.from_stacked({"w": torch.zeros(E, 1024, 256, dtype=torch.bfloat16)}, num_experts=E)
    store = CpuExpertStore(lay, G * E)
    for uid in range(G * E):
        store.write(uid, {"w": torch.full((1024, 256), float(uid), dtype=torch.bfloat16)})
    c = ExpertCache(store, G, E, slots, "cuda", CachePolicy.LRU, prefetch_chunk_bytes=chunk_bytes,
                    stage_guesses=stage)
    rng = random.Random(0)
    sums = []
    for _ in range(300):
        g = rng.randrange(G)
        want = sorted(rng.sample(range(E), rng.randint(1, slots)))
        held = c.acquire(g, want)
        for e, s in zip(want, held):   # queued on the compute stream after the load event
            sums.append((g * E + e, c.slot(g, s)[:1024 * 256].float().mean()))
        c.prefetch((g + 1) % G, rng.sample(range(E), 2))
        c.release(g, held)
    torch.cuda.synchronize()
    for uid, m in sums:
        assert float(m) == float(uid)
    assert c.stats()["gpu_stall_ms"] >= 0.0
    c.close()
