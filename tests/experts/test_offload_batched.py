"""Beyond batch 1: offloaded experts under batched greedy decode (8 and 32 sequences of different lengths, left
padded with an attention mask, as ``generate`` runs a batch) and under a long prefill, where a layer's batch routes to
more experts than it has slots (the cache's rounds: docs/moe_inference.md, "Batches and prefill"). Each run is checked
against the un-offloaded model: the same greedy tokens and logits within fp32 tolerance; with ``moe.quant`` against
the model holding the dequantized weights; with ``moe.cpu_compute`` (misses, auto) as well. The hooks on the
offloaded modules record how many distinct experts each layer call hit, so every test asserts the overflow path ran."""
import contextlib

import pytest
import torch

from ds_maximus.experts import OffloadedExperts, offload_experts
from tests.helpers.threads import torch_threads

from .test_quant_offload import GROUP, dequantized_model
from .tiny_moe import clone, tiny_model

NEW_TOKENS = 8
PAD = 0
# eager / grouped_mm over slot rounds repeat the model's ops row for row: on the CPU, fp32 logits equal bit for bit
EXACT_TOL = dict(rtol=0, atol=0)
# the host op accumulates each expert in its own order and adds the experts' sum in a different order
HOST_TOL = dict(rtol=1e-4, atol=1e-4)


def batch_prompts(batch: int, max_len: int = 12, min_len: int = 3, seed: int = 11):
    """``batch`` prompts of different lengths, left padded with ``PAD`` (``input_ids``, ``attention_mask``)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=g)
    lengths[0] = max_len  # the longest sets the padded width
    ids = torch.full((batch, max_len), PAD, dtype=torch.long)
    mask = torch.zeros((batch, max_len), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, max_len - n:] = torch.randint(1, 128, (n,), generator=g)
        mask[i, max_len - n:] = 1
    assert (mask == 0).any(), "some prompt must be padded"
    return ids, mask


def greedy(model, ids, mask, new_tokens=NEW_TOKENS):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=PAD)
    return out.sequences, torch.stack(out.logits)


def experts_hit(handle):
    """Per offloaded-layer call, the distinct experts its batch routed to (recorded by forward pre-hooks)."""
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append(int(args[1].unique().numel())))
             for m in handle.modules]
    return seen, hooks


def run_offloaded(model, cfg, ids, mask, new_tokens=NEW_TOKENS):
    handle = offload_experts(model, cfg)
    seen, hooks = experts_hit(handle)
    try:
        assert all(isinstance(b.block.experts, OffloadedExperts) for b in handle.blocks)
        seq, logits = greedy(model, ids, mask, new_tokens)
        return seq, logits, handle.stats(), seen, handle.cache.slots_per_group
    finally:
        for h in hooks:
            h.remove()
        handle.close()


def check(model, cfg, ids, mask, ref=None, tol=EXACT_TOL, new_tokens=NEW_TOKENS):
    """Offloaded greedy decode of the batch equals ``ref``'s (default: the model itself, un-offloaded)."""
    ref = clone(model) if ref is None else ref
    seq_ref, logits_ref = greedy(ref, ids, mask, new_tokens)
    seq, logits, st, seen, slots = run_offloaded(model, cfg, ids, mask, new_tokens)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, **tol)
    assert max(seen) > slots, (seen, slots)  # some layer served more experts than its slots hold
    assert st["tokens"] > 0
    # the handle's own count of experts hit per layer call (what the benchmark reports) is the hooks' count
    assert st["layer_calls"] == len(seen) and st["experts_per_layer_max"] == max(seen)
    assert st["experts_per_layer"] == pytest.approx(sum(seen) / len(seen))
    return st, seen, slots


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("batch", [8, 32])
@pytest.mark.parametrize("slots", [1, 2])
def test_batched_decode_equals_the_model(kind, batch, slots):
    """Batch 8 / 32, left padded, top-2 of 8 experts with 1 slot (fewer than top-k) or 2 a layer: every decode step
    routes the batch to more experts than the slots hold."""
    model = tiny_model(kind, top_k=2)
    ids, mask = batch_prompts(batch)
    st, seen, _ = check(model, {"gpu_experts_per_layer": slots}, ids, mask)
    # every layer call of the decode steps (not only the prefill) overflowed: the rounds are the common case here
    assert sum(n > slots for n in seen) >= len(seen) - 2
    assert st["demand_misses"] > 0 and 0.0 <= st["hit_rate"] < 1.0


def test_batched_decode_eager_is_bit_exact():
    """The eager loop in rounds (resident experts first) still adds the experts in ascending id: bit for bit."""
    model = tiny_model("mixtral", "eager", top_k=2)
    ids, mask = batch_prompts(8)
    check(model, {"gpu_experts_per_layer": 1}, ids, mask, tol=EXACT_TOL)


@pytest.mark.parametrize("impl", ["grouped_mm", "eager", "batched_mm"])
@pytest.mark.parametrize("slots", [1, 2, 4])
def test_overflowing_layers_use_their_resident_experts_first(impl, slots):
    """A decode step that routes a layer to more experts than its slots computes the resident ones first: with
    prefetch off, nearly every decode step's layer call hits its ``slots`` experts left from the step before
    (rounds in plain ascending id evict them first: a hit rate of 0). The outputs stay the model's."""
    model = tiny_model("mixtral", impl, top_k=2)
    ids, mask = batch_prompts(8)
    tol = EXACT_TOL if impl != "batched_mm" else dict(rtol=1e-4, atol=1e-4)
    st, seen, _ = check(model, {"gpu_experts_per_layer": slots, "speculative_prefetch": False}, ids, mask, tol=tol)
    decode_calls = len(seen) - 2  # the prefill's call of each of the 2 layers starts from empty slots
    assert st["demand_hits"] >= 0.75 * slots * decode_calls, (st["demand_hits"], seen)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_batched_decode_prefetch_off_equals_on(kind):
    """Speculative prefetch only moves experts earlier: with it off the batch decodes to the same tokens."""
    model = tiny_model(kind, top_k=2, layers=3)
    ids, mask = batch_prompts(8)
    on, _, _ = check(clone(model), {"gpu_experts_per_layer": 2}, ids, mask)
    off, _, _ = check(model, {"gpu_experts_per_layer": 2, "speculative_prefetch": False}, ids, mask)
    assert on["prefetch_issued"] > 0 and off["prefetch_issued"] == 0


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("mode", ["misses", "auto"])
def test_batched_decode_with_cpu_compute(kind, mode):
    """cpu_compute with a batch: misses sends every non-resident expert to the host; auto (max 2 tokens) those the
    batch routes at most 2 tokens to, the crowded ones to the slots in rounds. Both equal the model."""
    model = tiny_model(kind, top_k=2)
    ids, mask = batch_prompts(8)
    cfg = {"gpu_experts_per_layer": 1, "cpu_compute": mode, "cpu_compute_max_tokens": 2}
    st, _, _ = check(model, cfg, ids, mask, tol=HOST_TOL)
    assert st["cpu_experts"] > 0
    if mode == "auto":
        assert st["demand_misses"] > 0  # crowded experts went to the device
        assert st["cpu_expert_tokens"] <= 2 * st["cpu_experts"]


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("cpu_compute", ["off", "auto"])
def test_batched_decode_int8_equals_the_dequantized_model(kind, cpu_compute):
    """moe.quant bits=8 with a batch, 1 slot: the packed slots in rounds (and the host for auto's sparse misses)
    equal the plain model holding the dequantized weights."""
    model = tiny_model(kind, "eager", top_k=2)
    ids, mask = batch_prompts(8)
    ref = dequantized_model(model, 8, GROUP[kind])
    cfg = {"gpu_experts_per_layer": 1, "quant": {"bits": 8, "group_size": GROUP[kind]}, "cpu_compute": cpu_compute,
           "cpu_compute_max_tokens": 2}
    st, _, _ = check(model, cfg, ids, mask, ref=ref, tol=HOST_TOL)
    assert st["quant_bits"] == 8
    assert (st.get("cpu_experts", 0) > 0) == (cpu_compute == "auto")


def long_prompt(length: int, batch: int = 1, seed: int = 5):
    ids = torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


def _long_model(kind, **kw):
    model = tiny_model(kind, top_k=2, **kw)
    model.config.max_position_embeddings = 1024  # the prompt is longer than tiny_model's default
    return model


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("slots", [1, 2])
def test_long_prefill_equals_the_model(kind, slots):
    """A 512-token prompt: every layer's prefill hits all 8 experts with 1 or 2 slots (prefetch on), then decode."""
    model = _long_model(kind)
    ids, mask = long_prompt(512)
    st, seen, _ = check(model, {"gpu_experts_per_layer": slots}, ids, mask, new_tokens=4)
    assert max(seen) == 8
    assert st["prefetch_issued"] > 0


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("mode", ["misses", "auto"])
def test_long_prefill_with_cpu_compute(kind, mode):
    """cpu_compute over a 512-token prefill: auto sends the crowded prefill experts to the slots (in rounds), the
    decode's sparse misses to the host; misses computes every non-resident expert on the host, many tokens each."""
    model = _long_model(kind)
    ids, mask = long_prompt(512)
    cfg = {"gpu_experts_per_layer": 1, "cpu_compute": mode}
    st, _, _ = check(model, cfg, ids, mask, tol=HOST_TOL, new_tokens=4)
    assert st["cpu_experts"] > 0
    if mode == "auto":
        assert st["demand_misses"] >= 2 * 7  # the prefill: every expert a layer through the slot, 2 layers
    else:
        assert st["cpu_expert_tokens"] > 512  # the prefill's misses, many tokens an expert


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_long_prefill_int8_equals_the_dequantized_model(kind):
    model = _long_model(kind, experts_impl="eager")
    ids, mask = long_prompt(512)
    ref = dequantized_model(model, 8, GROUP[kind])
    cfg = {"gpu_experts_per_layer": 2, "quant": {"bits": 8, "group_size": GROUP[kind]}, "cpu_compute": "auto"}
    st, seen, _ = check(model, cfg, ids, mask, ref=ref, tol=HOST_TOL, new_tokens=4)
    assert max(seen) == 8 and st["quant_bits"] == 8


@pytest.mark.parametrize("cpu_compute", ["off", "auto"])
def test_batched_long_prefill_then_decode(cpu_compute):
    """Batch 8 of 128-512-token prompts, left padded: a large padded prefill, then batched decode. Without CPU
    compute the logits are bit-identical with one intra-op thread. With two, on an Intel AVX-512 host (MKL), 3.5% of
    them differed by up to 4.5e-8 (fp32 rounding; the un-offloaded model equals itself run to run), so the
    bit-identity is checked on one thread (README, "Offloaded MoE inference")."""
    model = _long_model("qwen3_moe")
    ids, mask = batch_prompts(8, max_len=512, min_len=128)
    cfg = {"gpu_experts_per_layer": 1, "cpu_compute": cpu_compute}
    with torch_threads(1) if cpu_compute == "off" else contextlib.nullcontext():
        check(model, cfg, ids, mask, tol=HOST_TOL if cpu_compute != "off" else EXACT_TOL, new_tokens=4)


# -- CUDA: the same on the device, and the 2,048-token prefill -------------------------------------------

def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("batch", [8, 32])
@pytest.mark.parametrize("cpu_compute", ["off", "auto"])
def test_batched_decode_cuda(kind, batch, cpu_compute):
    """On CUDA (fp32): the slots loaded on the side stream with prefetch, 1 slot a layer, batch 8 / 32."""
    _needs_cuda()
    model = tiny_model(kind, top_k=2).cuda()
    ids, mask = batch_prompts(batch)
    cfg = {"gpu_experts_per_layer": 1, "cpu_compute": cpu_compute, "cpu_compute_max_tokens": 2}
    check(model, cfg, ids.cuda(), mask.cuda(), tol=HOST_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("cpu_compute", ["off", "auto"])
def test_prefill_2048_cuda(kind, cpu_compute):
    """The issue's 2,048-token prefill on CUDA, 1 and 2 slots a layer, then a short decode."""
    _needs_cuda()
    model = tiny_model(kind, top_k=2)
    model.config.max_position_embeddings = 4096
    model = model.cuda()
    ids, mask = long_prompt(2048)
    for slots in (1, 2):
        st, seen, _ = check(clone(model), {"gpu_experts_per_layer": slots, "cpu_compute": cpu_compute},
                            ids.cuda(), mask.cuda(), tol=HOST_TOL, new_tokens=4)
        assert max(seen) == 8


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_batched_decode_int8_cuda(kind):
    """moe.quant bits=8 on CUDA (the Triton kernel) with batch 8 and a 512-token prefill."""
    _needs_cuda()
    pytest.importorskip("triton")
    model = tiny_model(kind, "eager", top_k=2)
    model.config.max_position_embeddings = 1024
    ref = dequantized_model(model, 8, GROUP[kind]).cuda()
    model = model.cuda()
    cfg = {"gpu_experts_per_layer": 1, "quant": {"bits": 8, "group_size": GROUP[kind]}}
    for ids, mask in (batch_prompts(8), long_prompt(512)):
        check(clone(model), cfg, ids.cuda(), mask.cuda(), ref=clone(ref), tol=HOST_TOL, new_tokens=4)
