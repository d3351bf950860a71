"""PEFT's frozen ``original_module`` beside a maximus table lives in host memory (ds_maximus.vocab.host_table).

Once ``ds_maximus.initialize`` swaps a ``ModulesToSaveWrapper``'s trained copy, the frozen original is a
``HostTable``: nothing the engine's ``module.to(device)`` moves is a V-row table (counted by applying a recording
function through the model, as ``.to()`` does), ``with model.disable_adapter():`` gives the original model's
logits after training, the state dict keeps the original's keys and values, and ``load_state_dict`` writes into
the host copy. The GPU test checks the same on CUDA by the device's own tensors.
"""
import warnings

import pytest
import torch
from torch import nn

from ds_maximus.integrations.peft import save_peft
from ds_maximus.vocab import ShardedEmbedding
from ds_maximus.vocab.host_table import HostTable
from tests.conformance.helpers import ds_config, zipf_ids
from tests.helpers.models import initialize, train
from tests.integrations.test_peft_vocab import EMB, HEAD, VOCAB, _batches, _reload, gemma3, llama, lora, section


def _moved_by_to(model: nn.Module):
    """Every tensor ``model.to(device)`` would move (``_apply`` is how ``.to`` reaches parameters and buffers)."""
    seen = []

    def record(t):
        seen.append(t)
        return t

    model._apply(record)
    return seen


def _vocab_tables(tensors, vocab):
    return [tuple(t.shape) for t in tensors if t.dim() == 2 and vocab in t.shape]


CASES = {
    "gemma3_tied": (lambda: gemma3(), ("embed_tokens",), True),
    "gemma3_peft_untie": (lambda: gemma3(), ("embed_tokens", "lm_head"), False),
    "llama_untied": (lambda: llama(), ("embed_tokens", "lm_head"), False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_frozen_original_leaves_the_compute_device_and_disable_adapter_gives_the_original(case):
    make, mts, tie = CASES[case]
    plain = lora(make(), mts, tie=tie)
    assert _vocab_tables(_moved_by_to(plain), VOCAB)       # plain PEFT: the tables would go to the device
    ids = zipf_ids(1, batch=2, seqlen=8, vocab=VOCAB, seed=7)[0]
    with torch.no_grad():
        out = make().eval()(input_ids=ids, labels=ids)
        want, want_loss = out.logits, out.loss

    sec = section()
    if not tie:   # an untied trained head copy in the CPU tier too (placement gpu keeps it a dense Parameter)
        sec["lm_head"]["placement"] = "cpu"
    engine = initialize(lora(make(), mts, tie=tie), ds_config(0, clip=0.5, maximus=sec))
    model = engine.module
    wrappers = [model.get_submodule(EMB), model.get_submodule(HEAD)]
    originals = [w.original_module for w in wrappers if hasattr(w, "original_module")]
    assert originals and all(isinstance(o, HostTable) for o in originals)
    if case == "gemma3_peft_untie":   # the originals shared the tied table: they still share one host tensor
        assert originals[0].weight is originals[1].weight
    assert _vocab_tables(_moved_by_to(model), VOCAB) == []   # no V-row tensor for the engine to move
    assert all(not p.shape or VOCAB not in p.shape for p in model.parameters())
    assert all(o.weight.device.type == "cpu" and not o.weight.requires_grad for o in originals)

    train(engine, _batches(3))
    model.eval()
    with torch.no_grad():
        with model.disable_adapter():
            off = model(input_ids=ids).logits
            off_loss = model(input_ids=ids, labels=ids).loss   # the streamed loss through the original head
        on = model(input_ids=ids).logits
    torch.testing.assert_close(off, want, rtol=0, atol=0)          # the original model's forward, bit-equal
    torch.testing.assert_close(off_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(on, want)                              # the trained copies and LoRA are used again
    assert isinstance(model.get_submodule(EMB).modules_to_save["default"], ShardedEmbedding)


def test_state_dict_keeps_the_original_and_loads_into_the_host_copy(tmp_path):
    base = tmp_path / "base"
    gemma3().save_pretrained(base)
    ref = gemma3()
    engine = initialize(lora(gemma3()), ds_config(0, maximus=section()))
    train(engine, _batches(2))
    model = engine.module
    sd = model.state_dict()
    key = EMB + ".original_module.weight"
    assert torch.equal(sd[key], ref.model.embed_tokens.weight) and sd[key].dtype == ref.model.embed_tokens.weight.dtype

    host = model.get_submodule(EMB).original_module
    new = torch.randn_like(host.weight)
    missing, unexpected = model.load_state_dict({key: new}, strict=False)
    assert key not in missing and not unexpected
    assert torch.equal(host.weight, new)
    model.load_state_dict({key: sd[key]}, strict=False)

    # save_peft and a plain-peft reload are unchanged by the host original
    ids = zipf_ids(1, batch=2, seqlen=8, vocab=VOCAB, seed=7)[0]
    out = _reload(tmp_path, base, save_peft(engine, str(tmp_path / "adapter")), ids)
    model.eval()
    with torch.no_grad():
        got = model(input_ids=ids).logits.float()
    torch.testing.assert_close(out["logits"], got, rtol=1e-4, atol=1e-4)
    assert out["tied"]


def test_host_table_reproduces_embedding_and_head_forwards():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding
    torch.manual_seed(0)
    emb = Gemma3TextScaledWordEmbedding(50, 8, 0, embed_scale=8 ** 0.5).to(torch.bfloat16)
    head = nn.Linear(8, 50, bias=True)
    ids = torch.randint(0, 50, (2, 5))
    x = torch.randn(2, 5, 8, requires_grad=True)
    want_e, want_h = emb(ids), head(x)
    he, hh = HostTable(emb), HostTable(head, chunk_rows=7)
    torch.testing.assert_close(he(ids), want_e, rtol=0, atol=0)
    got = hh(x)                                       # 8 chunks of at most 7 rows
    torch.testing.assert_close(got, want_h, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(hh(x), want_h, rtol=1e-6, atol=1e-6)   # the no-graph path fills one tensor
    got.sum().backward()                              # autograd reaches the input, not the frozen table
    assert x.grad is not None and head.weight.grad is None
    assert he.num_embeddings == 50 and hh.out_features == 50 and he.padding_idx == 0
    he.half()
    assert he.weight.dtype == torch.float16 and he.weight.device.type == "cpu"
    with pytest.raises(TypeError, match="nn.Embedding or nn.Linear"):
        HostTable(nn.LayerNorm(4))


@pytest.mark.gpu
def test_frozen_original_stays_off_the_gpu():
    """On CUDA: after initialize no V-row tensor of the model is on the GPU, the host originals are on the CPU, and
    disable_adapter() (the streamed head chunks, the embedding gathered on the host) gives the original logits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    vocab = 4096
    ids = zipf_ids(1, batch=2, seqlen=16, vocab=vocab, seed=7)[0].cuda()
    with torch.no_grad():
        want = gemma3(vocab=vocab).cuda().eval()(input_ids=ids).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = lora(gemma3(vocab=vocab), ("embed_tokens", "lm_head"), tie=False)
    sec = section(vocab=vocab, cache_rows=256)
    sec["lm_head"]["chunk_rows"] = 1000
    sec["lm_head"]["placement"] = "cpu"  # the trained untied head copy in the CPU tier (gpu keeps it on the device)
    engine = initialize(model, ds_config(0, maximus=sec))
    cuda = [t for t in _moved_by_to(engine.module) if t.is_cuda]
    assert cuda and _vocab_tables(cuda, vocab) == []
    for w in (engine.module.get_submodule(EMB), engine.module.get_submodule(HEAD)):
        assert isinstance(w.original_module, HostTable) and w.original_module.weight.device.type == "cpu"
    engine.module.eval()
    with torch.no_grad(), engine.module.disable_adapter():
        off = engine.module(input_ids=ids).logits
    torch.testing.assert_close(off, want, rtol=1e-5, atol=1e-5)
