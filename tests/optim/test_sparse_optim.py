"""Row-block optimizer functions equal torch.optim on the same rows; RowOptimizer replay equals dense steps."""
import pytest
import torch

from ds_maximus.config import EmbeddingOptimizerConfig
from ds_maximus.errors import ConfigError
from ds_maximus.optim import RowOptimizer, SparseRowGrad, adagrad_rows_, adamw_rows_


def test_adamw_rows_equals_torch_adamw_bitwise():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(5, 7, generator=g)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=3e-3, weight_decay=0.2, betas=(0.8, 0.95), eps=1e-7, foreach=False)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 8):
        grad = torch.randn(5, 7, generator=g) if step % 3 else None  # zero-grad steps too
        ref.grad = grad if grad is not None else torch.zeros_like(p)
        opt.step()
        adamw_rows_(p, grad, m, v, step=step, lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-7, weight_decay=0.2)
    assert torch.equal(p, ref.detach())


def test_adagrad_rows_equals_torch_adagrad():
    g = torch.Generator().manual_seed(1)
    p = torch.randn(4, 3, generator=g)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.Adagrad([ref], lr=0.1, weight_decay=0.1, eps=1e-8, foreach=False)
    s = torch.zeros_like(p)
    for step in range(1, 6):
        grad = torch.randn(4, 3, generator=g) if step != 3 else None
        ref.grad = grad if grad is not None else torch.zeros_like(p)
        opt.step()
        adagrad_rows_(p, grad, s, step=step, lr=0.1, eps=1e-8, weight_decay=0.1)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=0)


def test_row_optimizer_replay_equals_stepping_every_row():
    cfg = EmbeddingOptimizerConfig(lr=1e-2, weight_decay=0.1)
    lazy_rows, eager_rows = RowOptimizer(cfg, 6), RowOptimizer(cfg, 6)
    g = torch.Generator().manual_seed(2)
    w0 = torch.randn(6, 4, generator=g)
    wa, wb = w0.clone(), w0.clone()
    sa = [torch.zeros(6, 4), torch.zeros(6, 4)]
    sb = [torch.zeros(6, 4), torch.zeros(6, 4)]
    all_ids = torch.arange(6)
    for step in range(12):
        ids = torch.tensor([step % 2, 5]) if step % 4 else torch.tensor([3])
        grads = torch.randn(ids.numel(), 4, generator=g)
        lr = 1e-2 / (1 + step)
        lazy_rows.begin_step(lr, None)
        eager_rows.begin_step(lr, None)
        lazy_rows.update(wa, sa, ids, grads, ids)  # replays only these rows' skipped steps
        dense = torch.zeros(6, 4)
        dense[ids] = grads
        eager_rows.update(wb, sb, all_ids, dense, all_ids)  # every row, every step
    lazy_rows.catch_up(wa, sa, all_ids, all_ids)
    torch.testing.assert_close(wa, wb, rtol=1e-6, atol=1e-7)
    assert torch.equal(lazy_rows.last_step, torch.full((6,), 12))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_update_with_a_device_index_made_ahead_equals_the_plain_update(device):
    """``device_index`` (made on a load stream ahead of the rows in the MoE step) gives the same update bit for bit,
    with skipped steps replayed, and the last steps advance as they do without it."""
    cfg = EmbeddingOptimizerConfig(lr=1e-2, weight_decay=0.1)
    plain, ahead = RowOptimizer(cfg, 6), RowOptimizer(cfg, 6)
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(6, 4, generator=g)
    wa, wb = w0.clone().to(device), w0.clone().to(device)
    sa = [torch.zeros(6, 4, device=device) for _ in range(2)]
    sb = [torch.zeros(6, 4, device=device) for _ in range(2)]
    for step in range(6):
        ids = torch.tensor([1, 4]) if step % 3 else torch.tensor([0, 1, 5])  # rows 0 and 5 skip steps
        grads = torch.randn(ids.numel(), 4, generator=g).to(device)
        for opt in (plain, ahead):
            opt.begin_step(1e-2 / (1 + step), None)
        index = ahead.device_index(ids, ids, torch.device(device))
        assert all(t.device.type == device for t in index)
        plain.update(wa, sa, ids, grads, ids)
        ahead.update(wb, sb, ids, grads, ids, index=index)
    assert torch.equal(wa, wb) and all(torch.equal(x, y) for x, y in zip(sa, sb))
    assert torch.equal(plain.last_step, ahead.last_step)


def test_row_optimizer_needs_lr_and_round_trips_state():
    opt = RowOptimizer(EmbeddingOptimizerConfig(), 3)
    with pytest.raises(ConfigError, match="lr"):
        opt.begin_step(None, None)
    opt.begin_step(0.5, 0.1)
    other = RowOptimizer(EmbeddingOptimizerConfig(), 3)
    other.load_state_dict(opt.state_dict())
    assert other.step == 1 and other.lr_hist == [0.0, 0.5] and other.wd_hist == [0.0, 0.1]
    with pytest.raises(ConfigError, match="rows"):
        RowOptimizer(EmbeddingOptimizerConfig(), 4).load_state_dict(opt.state_dict())


def test_sparse_row_grad_coalesces_norm_and_scale():
    g = SparseRowGrad()
    assert not g and g.norm_sq().item() == 0
    g.add(torch.tensor([5, 2]), torch.tensor([[1.0, 1.0], [2.0, 0.0]]))
    g.add(torch.tensor([2, 7]), torch.tensor([[1.0, 1.0], [0.0, 3.0]]))
    assert g.ids.tolist() == [2, 5, 7]
    assert g.rows.tolist() == [[3.0, 1.0], [1.0, 1.0], [0.0, 3.0]]
    assert g.norm_sq().item() == 9 + 1 + 1 + 1 + 9
    g.scale_(2.0)
    assert g.norm_sq().item() == 4 * 21 and g.finite()
