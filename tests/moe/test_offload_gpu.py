"""The same equalities on a CUDA device: side-stream loads, events, bf16. Skips without a GPU."""
import random

import pytest
import torch

from ds_maximus.config import CachePolicy
from ds_maximus.moe import offload_experts
from ds_maximus.moe.expert_cache import ExpertCache
from ds_maximus.moe.expert_store import CpuExpertStore
from ds_maximus.moe.layout import ExpertLayout

from .tiny_moe import clone, tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
@pytest.mark.parametrize("slots", [1, 8])
def test_generate_identical_cuda(kind, impl, slots):
    model = tiny_model(kind, impl, top_k=2, dtype=torch.bfloat16).cuda()
    ref = clone(model)
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(3)).cuda()
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, return_dict_in_generate=True,
              output_logits=True, pad_token_id=0)
    a = ref.generate(ids, **kw)
    h = offload_experts(model, {"gpu_experts_per_layer": slots})
    b = model.generate(ids, **kw)
    st = h.stats()
    h.close()
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(b.logits), torch.stack(a.logits), rtol=0, atol=0)
    assert st["bytes_moved"] > 0


def test_cuda_churn_contents():
    E, G, slots = 6, 3, 2
    lay = ExpertLayout.from_stacked({"w": torch.zeros(E, 1024, 256, dtype=torch.bfloat16)}, num_experts=E)
    store = CpuExpertStore(lay, G * E)
    for uid in range(G * E):
        store.write(uid, {"w": torch.full((1024, 256), float(uid), dtype=torch.bfloat16)})
    c = ExpertCache(store, G, E, slots, "cuda", CachePolicy.LRU)
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
