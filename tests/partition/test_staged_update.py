"""The staged-update pipeline against ``torch.optim.AdamW``, on the CPU (the GPU runs the same loop on streams):

* vocabulary rows: the LM head's :class:`StagedAdamW` over a ``[V, d]`` table in blocks of odd sizes, with rows
  that had no gradient (a zero-gradient step, as dense AdamW takes) and a clipping scale;
* expert partitions: MoE training's :class:`StagedStep` over experts that are each one flat row, cut into
  pieces smaller than one expert (or several experts a piece), through the real store, gradients and row
  optimizer.
"""
import pytest
import torch

from ds_maximus.partition.staged_update import BackgroundStep, StagedUpdate, device_with_index

BETAS, EPS = (0.9, 0.99), 1e-8
STEPS = [(1e-2, 0.1), (5e-3, 0.1), (2e-2, 0.0)]  # (lr, weight decay) of each step


def _torch_adamw(w0: torch.Tensor, grads, steps=STEPS):
    """``torch.optim.AdamW`` (one tensor, ``foreach=False``) over ``grads[i]`` with ``steps[i]``."""
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([p], lr=steps[0][0], betas=BETAS, eps=EPS, weight_decay=steps[0][1], foreach=False)
    for g, (lr, wd) in zip(grads, steps):
        for group in opt.param_groups:
            group["lr"], group["weight_decay"] = lr, wd
        p.grad = g.clone()
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


def test_pieces_alternate_the_two_staging_sets_and_buffers_are_kept():
    pl = StagedUpdate("cpu")
    assert [k for k, _ in pl.pieces(range(5))] == [0, 1, 0, 1, 0]
    a = pl.buffer(0, "w", 8)
    assert pl.buffer(0, "w", 6) is a and pl.buffer(1, "w", 8) is not a
    assert pl.buffer(0, "w", 9).numel() == 9 and pl.buffer(0, "w", 9, torch.bfloat16).dtype == torch.bfloat16
    assert pl.device_bytes() == 9 * 2 + 8 * 4
    pl.release()
    assert pl.device_bytes() == 0 and pl.end() is None
    assert device_with_index("cpu") == torch.device("cpu")


def test_background_step_returns_the_result_and_re_raises_the_workers_error():
    assert BackgroundStep(lambda: 7).event() == 7

    def boom():
        raise RuntimeError("link down")
    with pytest.raises(RuntimeError, match="link down"):
        BackgroundStep(boom).event()


@pytest.mark.parametrize("vocab,dim,rows", [(37, 5, 8), (16, 4, 16), (10, 3, 1), (9, 7, 64)])
def test_vocabulary_rows_equal_torch_adamw(vocab, dim, rows):
    from ds_maximus.vocab.lm_head_update import StagedAdamW
    g = torch.Generator().manual_seed(vocab * dim + rows)
    w0 = torch.randn(vocab, dim, generator=g)
    have = [torch.rand(vocab, generator=g) < 0.6 for _ in STEPS]
    grads = [torch.randn(vocab, dim, generator=g) * h[:, None] for h in have]  # no gradient: a zero one
    scale = 0.5
    host = {"weight": w0.clone(), "exp_avg": torch.zeros(vocab, dim), "exp_avg_sq": torch.zeros(vocab, dim)}
    mirror = {torch.bfloat16: torch.zeros(vocab, dim, dtype=torch.bfloat16)}
    opt = StagedAdamW("cpu", rows, dim)
    for i, ((lr, wd), grad, h) in enumerate(zip(STEPS, grads, have)):
        # rows without a gradient hold garbage there: the pipeline must zero them (as the head's tier does)
        host["grad"] = torch.where(h[:, None], grad, torch.full_like(grad, 1e3))
        assert opt.step(host, h, mirror, step=i + 1, lr=lr, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                        weight_decay=wd, grad_scale=scale) is None  # a CPU device: done on return
    want = _torch_adamw(w0, [gr * scale for gr in grads])
    for name, ref in zip(("weight", "exp_avg", "exp_avg_sq"), want):
        torch.testing.assert_close(host[name], ref, rtol=2e-6, atol=1e-7)
    assert torch.equal(mirror[torch.bfloat16], host["weight"].to(torch.bfloat16))


def _expert_parts(num_experts, elems, sub, chunk_elems, tmp_path=None, compute_dtype=torch.float32):
    """Parts of a one-layer store of ``num_experts`` experts of one tensor of ``elems`` (the flat row pads it)."""
    from ds_maximus.config import EmbeddingOptimizerConfig
    from ds_maximus.experts.expert_cache import ExpertCache
    from ds_maximus.experts.layout import ExpertLayout
    from ds_maximus.experts.training.grads import ExpertGrads
    from ds_maximus.experts.training.stats import ExpertTrainStats
    from ds_maximus.experts.training.step import STATE_BYTES, StepParts
    from ds_maximus.experts.training.store import ExpertTrainStore
    from ds_maximus.optim import RowOptimizer
    lay = ExpertLayout.from_stacked({"w": torch.zeros(num_experts, elems)}, num_experts=num_experts)
    numel = lay.numel
    opt = RowOptimizer(EmbeddingOptimizerConfig(lr=1e-2, betas=BETAS, eps=EPS), num_experts)
    store = ExpertTrainStore(lay, num_experts, opt.state_names, compute_dtype,
                             nvme_path=None if tmp_path is None else str(tmp_path / "experts"))
    cache = ExpertCache(store, 1, num_experts, 2, torch.device("cpu"))
    return StepParts(store=store, grads=ExpertGrads(torch.device("cpu"), num_experts), optimizer=opt,
                     counters=ExpertTrainStats(1, num_experts), num_layers=1, num_experts=num_experts, numel=numel,
                     sub=sub, step_chunk_bytes=chunk_elems * STATE_BYTES * (len(store.names) + 1), cache=cache)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("elems,sub,chunk_elems", [(96, 8, 40), (96, 8, 256 * 3), (60, 4, 20)])
def test_expert_partitions_equal_torch_adamw(tmp_path, tier, elems, sub, chunk_elems):
    """Pieces smaller than an expert (AdamW is elementwise: the expert's step bookkeeping is the same for each of
    its pieces), one expert, or several experts a piece; every expert's master and moments end where torch's
    AdamW puts the same flat parameter, and its compute copy (bf16 shadow, resident slot) is refreshed."""
    from ds_maximus.experts.training.step import StagedStep, pieces
    E = 5
    parts = _expert_parts(E, elems, sub, chunk_elems, tmp_path if tier == "nvme" else None,
                          torch.bfloat16 if tier == "cpu" else torch.float32)
    numel = parts.numel
    assert (len(list(pieces(parts, list(range(E))))) > E) == (chunk_elems < numel)
    g = torch.Generator().manual_seed(elems + chunk_elems)
    parts.store.write_layer(0, {"w": torch.randn(E, elems, generator=g)})
    w0 = parts.store.read_rows(torch.arange(E))["weight"]  # the flat rows, padding included
    grads = [torch.randn(E, numel, generator=g) for _ in STEPS]
    parts.cache.release(0, parts.cache.acquire(0, [1]))  # a resident slot, refreshed by the step
    step = StagedStep(parts)
    for (lr, wd), grad in zip(STEPS, grads):
        parts.optimizer.begin_step(lr, wd)
        for u in range(E):
            parts.grads.add(u, grad[u].clone())
        step.run(parts.grads.uids(), torch.device("cpu"))
        assert not parts.grads.uids()  # every gradient consumed
    want = _torch_adamw(w0, grads)
    got = parts.store.read_rows(torch.arange(E))
    for name, ref in zip(("weight", "exp_avg", "exp_avg_sq"), want):
        torch.testing.assert_close(got[name], ref, rtol=2e-6, atol=1e-7)
    assert parts.counters.experts_stepped == E * len(STEPS)
    copy = got["weight"].to(parts.store.layout.dtype)
    if parts.store.shadow is not None:
        assert torch.equal(parts.store.shadow, copy)
    slot = int(parts.cache.groups[0].map.id_to_slot[1])
    assert torch.equal(parts.cache.slot_buffer(0)[slot], copy[1])
