"""A streamed or tied ``ShardedLMHead`` called without labels returns differentiable logits: values, hidden
gradient and weight gradient equal ``F.linear``'s (the reference), chunk boundaries not dividing the vocab."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_maximus.config import EmbeddingConfig
from ds_maximus.vocab import ShardedEmbedding, ShardedLMHead

V, D = 50, 8


def _reference(weight, hidden, bias=None):
    w = weight.detach().clone().requires_grad_(True)
    h = hidden.detach().clone().requires_grad_(True)
    out = F.linear(h, w, bias)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * g).sum().backward()
    return out.detach(), h.grad, w.grad, g


@pytest.mark.parametrize("placement", ["cpu", "tied"])
def test_logits_and_grads_equal_f_linear(placement):
    torch.manual_seed(0)
    weight = torch.randn(V, D)
    hidden = torch.randn(2, 5, D)
    want, want_gh, want_gw, g = _reference(weight, hidden)
    if placement == "tied":
        emb = ShardedEmbedding.from_embedding(nn.Embedding(V, D, _weight=weight.clone(), padding_idx=0),
                                              EmbeddingConfig(gpu_cache_rows=8))
        head = ShardedLMHead(tied_to=emb, config={"chunk_rows": 16})
    else:
        head = ShardedLMHead(weight=weight, config={"chunk_rows": 16, "placement": "cpu"})
    h = hidden.clone().requires_grad_(True)
    out = head(h)
    assert out.requires_grad and out.shape == (2, 5, V)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    (out * g).sum().backward()
    torch.testing.assert_close(h.grad, want_gh, rtol=1e-5, atol=1e-6)
    ids, rows = emb.sparse_grads() if placement == "tied" else head.sparse_grads()
    got_gw = torch.zeros(V, D).index_copy_(0, ids.cpu(), rows.float().cpu())
    # every row, the padding row of a tied table included (padding_idx stops only the lookup's gradient)
    torch.testing.assert_close(got_gw, want_gw, rtol=1e-5, atol=1e-6)


def test_bias_is_a_trained_parameter():
    torch.manual_seed(0)
    weight, bias = torch.randn(V, D), nn.Parameter(torch.randn(V))
    head = ShardedLMHead(weight=weight, config={"chunk_rows": 16, "placement": "cpu"}, bias=bias)
    assert head.bias is bias and dict(head.named_parameters())["bias"] is bias
    hidden = torch.randn(3, D)
    out = head(hidden)
    torch.testing.assert_close(out, F.linear(hidden, weight, bias.detach()), rtol=1e-6, atol=1e-6)
    out.sum().backward()
    torch.testing.assert_close(bias.grad, torch.full((V,), 3.0))
    with pytest.raises(ValueError, match="bias"):
        head(hidden, labels=torch.zeros(3, dtype=torch.long))


def test_no_grad_logits_for_generation():
    head = ShardedLMHead(weight=torch.randn(V, D), config={"chunk_rows": 16, "placement": "cpu"})
    with torch.no_grad():
        out = head(torch.randn(1, 1, D, requires_grad=True))
    assert not out.requires_grad and out.shape == (1, 1, V)
