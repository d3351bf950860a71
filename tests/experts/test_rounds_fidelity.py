"""Fewer GPU slots than the experts a layer call routes to: the offloaded layer computes in rounds, and its bf16
output may differ from the model's own by rounding. This pins down that it is rounding and not a wrong expert: an
exact float64 computation of the same routed experts is the judge, and ours is as close to it as the model's own
expert implementations (``eager``, ``grouped_mm``), while the same layer with a wrong expert is not.

On CUDA the layer has the real Mixtral-8x7B expert size (hidden 4096, ffn 14336, 8 experts, top-2, bf16, one slot);
on the CPU a small twin runs the same checks.
"""
import copy

import pytest
import torch

from benchmarks.harness import default_dtype
from ds_maximus.experts import offload_experts
from ds_maximus.experts.adapters import find_moe_blocks

REAL = dict(hidden=4096, ffn=14336)     # Mixtral-8x7B
SMALL = dict(hidden=256, ffn=512)


def _layer(device, dtype, hidden, ffn, impl):
    """A one-layer Mixtral with random weights (N(0, 0.02), as HF's init) on ``device``, experts ``impl``."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.initialization import no_init_weights
    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=1, num_attention_heads=8,
                        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=256)
    cfg._experts_implementation = impl
    with default_dtype(dtype), torch.device(device), no_init_weights():
        model = MixtralForCausalLM(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).mul_(0.02))
    return model.eval()


def _routing(block, x):
    """Mixtral's routing of ``x``: top-2 of the softmax, renormalised, in the model's dtype."""
    probs = torch.softmax(block.router_logits(x).float(), dim=-1)
    w, idx = torch.topk(probs, 2, dim=-1)
    return idx, (w / w.sum(-1, keepdim=True)).to(x.dtype)


def _exact(tensors, x, idx, w):
    """The routed SwiGLU experts in float64 from the same (bf16) weights: the judge."""
    x64, out = x.double(), torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in idx.unique().tolist():
        tok, pos = (idx == e).nonzero(as_tuple=True)
        gate, up = (x64[tok] @ tensors["gate_up_proj"][e].double().t()).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ tensors["down_proj"][e].double().t()
        out.index_add_(0, tok, y * w[tok, pos, None].double())
    return out


def _err(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tokens", [1, 16])   # a decode step (2 experts, 2 rounds); a prefill (up to 8 rounds)
def test_rounds_differ_by_rounding_not_by_expert(device, tokens):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dims = REAL if device == "cuda" else SMALL
    dtype = torch.bfloat16
    models = {impl: _layer(device, dtype, **dims, impl=impl) for impl in ("eager", "grouped_mm")}
    block = find_moe_blocks(models["eager"])[0]
    tensors = {n: t.detach().clone() for n, t in block.expert_tensors().items()}
    x = torch.randn(tokens, dims["hidden"], generator=torch.Generator(device=device).manual_seed(1),
                    device=device, dtype=torch.float32).to(dtype)
    idx, w = _routing(block, x)
    exact = _exact(tensors, x, idx, w)
    with torch.no_grad():
        own = {impl: find_moe_blocks(m)[0].experts(x, idx, w) for impl, m in models.items()}
        ours_model = copy.deepcopy(models["eager"]) if device == "cpu" else models.pop("eager")
        handle = offload_experts(ours_model, {"gpu_experts_per_layer": 1})   # one slot: a round per expert
        try:
            ours = handle.modules[0](x, idx, w)
            rounds = handle.stats()["experts_per_layer"]
        finally:
            handle.close()
        wrong = _exact(tensors, x, (idx + 1) % 8, w)   # the same layer with each token's experts shifted by one
    err_own = max(_err(o, exact) for o in own.values())
    err_ours, err_wrong = _err(ours, exact), _err(wrong.to(dtype), exact)
    assert rounds >= 2, "the layer call must route to more experts than its one slot"
    # ours is within bf16 rounding of the exact result, as close as the model's own implementations
    assert err_ours <= max(1.5 * err_own, 4e-3), (err_ours, err_own)
    assert err_wrong > 0.3 and err_wrong > 50 * err_ours, (err_wrong, err_ours)   # a wrong expert is no rounding
