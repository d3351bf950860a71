"""maximus (exact sparse AdamW) trains a tiny Llama like plain DeepSpeed, under ZeRO 0-3, fp32 and bf16.

Tolerances: fp32 losses rtol 1e-5 (the only differences are summation order in the sparse gradient
reduction); fp32 weights per ``assert_weights_close`` (99.5% of elements within 1e-5, all within one
lr step: Adam amplifies last-bit summation differences where an accumulated gradient nearly cancels).
bf16 losses atol 2e-2 (DeepSpeed keeps bf16 module weights with an fp32 master; maximus
keeps the table fp32 and casts rows to bf16 on lookup, as DeepSpeed's module copy does; a row seen several times
in a batch sums its gradient in fp32 where DeepSpeed's bf16 lookup backward sums in bf16). The first step of
DeepSpeed's ZeRO-0 bf16 wrapper is matched exactly (its initial zero-gradient step, last test).
"""
import pytest
import torch

from tests.engine.llama_utils import build, embedding_weight, maximus_section
from tests.helpers.models import assert_weights_close, train, zipf_batches

GAS = 4
STEPS = 20


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_plain_deepspeed(stage, dtype):
    batches = zipf_batches(STEPS * GAS, batch=2, seqlen=16)
    plain = build(stage, dtype, gas=GAS, clip=0.5)
    ref = train(plain, batches)
    ref_w = embedding_weight(plain)
    ours = build(stage, dtype, gas=GAS, clip=0.5, maximus=maximus_section(cache_rows=96))
    got = train(ours, batches)
    got_w = embedding_weight(ours)
    assert ours.maximus.steps == STEPS
    if dtype == "fp32":
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)
        assert_weights_close(got_w, ref_w)
    else:
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=0, atol=2e-2)
    # clipping was active (the coefficient is < 1 early in training)
    assert ours.maximus.last_clip_coef <= 1.0


def test_clip_coefficient_includes_sparse_norm():
    """With only the embedding trainable, the global norm is the sparse norm alone."""
    batches = zipf_batches(4, batch=2, seqlen=16)
    ours = build(2, "fp32", clip=1e-3, maximus=maximus_section(cache_rows=64))
    train(ours, batches[:1])
    total = ours.get_global_grad_norm()
    assert total is not None and float(total) > 1e-3
    assert ours.maximus.last_clip_coef == pytest.approx(1e-3 / (float(total) + 1e-6), rel=1e-6)


def test_stage0_dense_norm_is_the_per_parameter_sum():
    """Under ZeRO-0 in fp32 the clip uses the dense gradients' norm, read in one copy: the same float as adding
    each parameter's fp32 square sum in double, parameter by parameter."""
    import math
    ours = build(0, "fp32", clip=0.5, maximus=maximus_section(cache_rows=64))
    ids = zipf_batches(1, batch=2, seqlen=16)[0]
    ours.backward(ours(input_ids=ids, labels=ids).loss)
    sq = 0.0
    for p in ours.module.parameters():
        if p.grad is not None:
            sq += float(p.grad.detach().float().pow(2).sum())
    assert sq > 0 and ours.maximus._dense_norm_stage0_fp32() == math.sqrt(sq)
    ours.step()


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_bf16_zero0_rows_take_deepspeeds_initial_step(wd):
    """DeepSpeed's ZeRO-0 bf16/fp16 wrapper steps its optimizer once with zero gradients when it is built, so a
    dense table's first real AdamW update is bias-corrected as step 2 (0.735 lr at betas 0.9/0.95, not lr) after
    one weight decay. The sharded rows take that step too: after one real step their fp32 values equal the plain
    engine's fp32 master, touched rows (each id once in the batch: the same bf16 gradient) and untouched ones."""
    import copy
    torch.manual_seed(0)
    model = build(0, "bf16", wd=wd, scheduler=False).module   # only for its weights
    init = copy.deepcopy(model.state_dict())
    ids = torch.randperm(200)[:32].view(2, 16)                  # 32 distinct rows
    plain = build(0, "bf16", wd=wd, scheduler=False, init=init)
    ours = build(0, "bf16", wd=wd, scheduler=False, init=init, maximus=maximus_section(cache_rows=16))
    for e in (plain, ours):
        e.backward(e(input_ids=ids, labels=ids).loss)
        e.step()
    emb = plain.module.model.embed_tokens.weight
    (master,) = [m for g16, g32 in zip(plain.optimizer.fp16_groups, plain.optimizer.fp32_groups)
                 for p, m in zip(g16, g32) if p is emb]
    got = embedding_weight(ours)
    start = init["model.embed_tokens.weight"].float()
    touched = torch.zeros(got.shape[0], dtype=torch.bool)
    touched[ids.flatten()] = True
    moved = (master.detach() - start)[touched].abs()
    assert 0.7 * 1e-2 < float(moved.median()) < 0.76 * 1e-2     # the second-step bias correction
    torch.testing.assert_close(got, master, rtol=0, atol=1e-6)


def test_bf16_zero0_cpu_head_takes_deepspeeds_initial_step():
    """The same initial step for an untied head in the CPU tier (``lm_head.placement: cpu``): after one real step
    its fp32 master equals the plain engine's ``lm_head`` master (the first update 0.735 lr, not lr)."""
    import copy
    torch.manual_seed(0)
    init = copy.deepcopy(build(0, "bf16", wd=0.1, scheduler=False).module.state_dict())
    ids = torch.randperm(200)[:32].view(2, 16)
    plain = build(0, "bf16", wd=0.1, scheduler=False, init=init)
    sec = maximus_section(cache_rows=16)
    sec["lm_head"] = {"enabled": True, "placement": "cpu", "chunk_rows": 64}
    ours = build(0, "bf16", wd=0.1, scheduler=False, init=init, maximus=sec)
    for e in (plain, ours):
        e.backward(e(input_ids=ids, labels=ids).loss)
        e.step()
    head = plain.module.lm_head.weight
    (master,) = [m for g16, g32 in zip(plain.optimizer.fp16_groups, plain.optimizer.fp32_groups)
                 for p, m in zip(g16, g32) if p is head]
    got = ours.module.lm_head.full_weight()
    moved = (master.detach() - init["lm_head.weight"].float()).abs()
    assert 0.7 * 1e-2 < float(moved.median()) < 0.76 * 1e-2
    torch.testing.assert_close(got, master.detach(), rtol=0, atol=1e-6)
