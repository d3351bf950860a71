"""One rank of the PartitionedEmbedding tests (no DeepSpeed engine): started N times by ``ranks.py``.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python rank_worker.py equal,bad_id /tmp/out
"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

VOCAB, DIM, STEPS = 96, 8, 6


def batches(world):
    g = torch.Generator().manual_seed(3)
    p = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
    return [torch.multinomial(p, world * 2 * 5, replacement=True, generator=g).view(world * 2, 5)
            for _ in range(STEPS)]


def device():
    """Each rank's GPU under ``MAXIMUS_TEST_RANKS=cuda`` (NCCL), else the CPU (gloo)."""
    if os.environ.get("MAXIMUS_TEST_RANKS", "cpu") == "cuda":
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cpu")


def make(world, **kw):
    from ds_maximus.config import EmbeddingConfig
    from ds_maximus.distributed import PartitionedEmbedding
    torch.manual_seed(0)
    w = torch.randn(VOCAB, DIM)
    cfg = EmbeddingConfig(gpu_cache_rows=16, optimizer={"lr": 0.05, "weight_decay": 0.1})
    return PartitionedEmbedding(VOCAB, DIM, padding_idx=1, config=cfg, _weight=w, device=device(), **kw), w, cfg


def equal(rank, world, out):
    """Train ``STEPS`` steps; rank 0 saves losses and the table."""
    emb, _, _ = make(world)
    losses = []
    for ids in batches(world):
        local = ids[rank * 2:(rank + 1) * 2].to(device())
        y = emb(local)
        loss = (y * torch.linspace(-1, 1, DIM, device=y.device)).pow(2).mean()
        loss.backward()
        emb.sparse_step()
        t = loss.detach().reshape(1)
        dist.all_reduce(t)
        losses.append(float(t) / world)
    w = emb.full_weight()
    if rank == 0:
        torch.save({"losses": losses, "weight": w, "table_bytes": emb.table_bytes(), "stats": emb.stats(),
                    "backend": dist.get_backend(), "device": str(emb.compute_device)}, out)


def weight_view(rank, world, out, emb=None):
    """``emb.weight`` of a partitioned table: metadata with no collective; row reads (different rows on each rank)
    from their owners; the whole table by any other use; a step after a loss through the padding row read as a
    weight (Gemma-4 multimodal's ``weight[pad_id, :]``) and a lookup. Rank 0 saves what it saw."""
    from ds_maximus.distributed import collectives
    torch.manual_seed(0)
    w = torch.randn(VOCAB, DIM)
    emb = emb if emb is not None else make(world)[0]
    called = []
    real = dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **k: called.append(1) or real(*a, **k)
    assert collectives.dist is dist
    v = emb.weight
    meta = (tuple(v.shape), v.dtype, str(v.device), v.requires_grad, len(v))
    meta_calls = len(called)
    with torch.no_grad():
        mine = [5, 9, 5] if rank == 0 else [70]
        rows = v[torch.tensor(mine)].cpu()
        row = v[-1].cpu()
        whole = emb.weight.t().t().cpu()
    ids = batches(world)[0][rank * 2:(rank + 1) * 2].to(device())
    x = torch.linspace(-1, 1, DIM, device=device())
    loss = (emb(ids) * x).pow(2).mean() + (emb.weight[1, :] * x * (rank + 1)).sum()
    loss.backward()
    emb.sparse_step()
    after = emb.full_weight()
    if rank == 0:
        torch.save({"meta": meta, "meta_calls": meta_calls, "rows": rows, "row": row, "mine": mine, "whole": whole,
                    "w": w, "after": after}, out)


def weight_view_broadcast(rank, world, out):
    """``weight_view`` of a broadcast table (the last rank the master, holding every row)."""
    from ds_maximus.config import EmbeddingConfig
    from ds_maximus.distributed.broadcast import BroadcastEmbedding
    master = world - 1
    torch.manual_seed(0)
    w = torch.randn(VOCAB, DIM)
    emb = BroadcastEmbedding(VOCAB, DIM, padding_idx=1, device=device(), master_rank=master,
                             config=EmbeddingConfig(gpu_cache_rows=16, optimizer={"lr": 0.05, "weight_decay": 0.1}),
                             _weight=w if rank == master else torch.zeros(VOCAB, DIM))
    weight_view(rank, world, out, emb)


def train(emb, rank, world, steps, start=0):
    """Train ``emb`` on this rank's share of batches ``[start, steps)``; returns the mean losses over the ranks."""
    losses = []
    for ids in batches(world)[start:steps]:
        local = ids[rank * 2:(rank + 1) * 2].to(device())
        y = emb(local)
        loss = (y * torch.linspace(-1, 1, DIM, device=y.device)).pow(2).mean()
        loss.backward()
        emb.sparse_step()
        t = loss.detach().reshape(1)
        dist.all_reduce(t)
        losses.append(float(t) / world)
    return losses


def broadcast(rank, world, out):
    """Broadcast mode, master rank 1 (of 2) or 0 (of 1): train ``STEPS`` steps with a checkpoint round trip at
    step 3 (the master saves; a fresh table from another start loads it); rank 0 saves losses, the table, every
    rank's bytes held and the stats."""
    from ds_maximus.config import EmbeddingConfig
    from ds_maximus.distributed.broadcast import BroadcastEmbedding
    master = world - 1
    cfg = EmbeddingConfig(gpu_cache_rows=16, optimizer={"lr": 0.05, "weight_decay": 0.1})
    torch.manual_seed(0)
    w = torch.randn(VOCAB, DIM)
    emb = BroadcastEmbedding(VOCAB, DIM, padding_idx=1, config=cfg, device=device(), master_rank=master,
                             _weight=w if rank == master else torch.randn(VOCAB, DIM))  # others' rows are unused
    losses = train(emb, rank, world, 3)
    ckpt = f"{out}.maximus_states.pt"  # written and read by the master alone, as the engine does
    if rank == master:
        torch.save({"modules": {"emb": emb.maximus_state_dict()}, "steps": 3, "skipped_steps": 0}, ckpt)
    dist.barrier()
    emb = BroadcastEmbedding(VOCAB, DIM, padding_idx=1, config=cfg, device=device(), master_rank=master,
                             _weight=torch.zeros(VOCAB, DIM))
    from ds_maximus.config import MaximusConfig
    from ds_maximus.distributed.broadcast import load_broadcast_state
    state = load_broadcast_state(ckpt, MaximusConfig(distributed={"shard_mode": "broadcast", "master_rank": master}))
    emb.load_maximus_state_dict(state["modules"]["emb"])
    losses += train(emb, rank, world, STEPS, start=3)
    w = emb.full_weight()
    held = torch.tensor([float(emb.table_bytes()), float(emb.tier_bytes())], dtype=torch.float64,
                        device=device())
    every = [torch.zeros_like(held) for _ in range(world)]
    dist.all_gather(every, held)
    if rank == 0:
        torch.save({"losses": losses, "weight": w, "held": [e.tolist() for e in every], "stats": emb.stats(),
                    "step": emb.local.optimizer.step, "received": state["modules"]["emb"]}, out)


def single(rank, world, out):
    """One rank: a partitioned table takes the plain path. Every torch.distributed collective called is counted
    (and still runs); trains ``STEPS`` steps with prefetch and a tied-head style gradient."""
    from ds_maximus.distributed import collectives
    called = []
    for name in ("all_to_all_single", "all_gather", "all_reduce", "broadcast", "reduce"):
        real = getattr(dist, name)
        setattr(dist, name, (lambda real, name: lambda *a, **k: called.append(name) or real(*a, **k))(real, name))
    assert collectives.dist is dist
    emb, _, _ = make(world)
    built = list(called)
    losses, hist = [], batches(world)
    emb.prefetch(hist[0])
    for i, ids in enumerate(hist):
        y = emb(ids.to(device()))
        if i + 1 < len(hist):
            emb.prefetch(hist[i + 1])
        loss = (y * torch.linspace(-1, 1, DIM, device=y.device)).pow(2).mean()
        loss.backward()
        emb.grad.add(torch.arange(4, 8), torch.full((4, DIM), 0.01, device=device()))  # as a tied head adds
        emb.sparse_step()
        losses.append(float(loss.detach()))
    rows = emb.rows_for_compute(0, 8)
    torch.save({"losses": losses, "weight": emb.full_weight(), "rows": rows.cpu(), "called": called,
                "built": built, "stats": emb.stats(), "local_type": type(emb.local).__name__}, out)


def bad_id(rank, world, out):
    emb, _, _ = make(world, timeout_s=60)
    ids = torch.tensor([[2, 3]]) if rank == 0 else torch.tensor([[5, VOCAB + 7]])
    emb(ids.to(device()))


def die(rank, world, out):
    emb, _, _ = make(world, timeout_s=20)
    ids = torch.tensor([[2, 3, 40, 77]], device=device())
    y = emb(ids)
    if rank == world - 1:
        os._exit(7)  # killed mid-step, before backward
    time.sleep(0.5)
    y.sum().backward()


def hang(rank, world, out):
    emb, _, _ = make(world, timeout_s=3)
    y = emb(torch.tensor([[2, 3, 40, 77]], device=device()))
    if rank == world - 1:
        time.sleep(6)  # alive but never joins the backward collective
        os._exit(0)
    y.sum().backward()


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                            timeout=__import__("datetime").timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    rc = 0
    for name in scenario.split(","):  # several scenarios in one start-up (imports cost seconds per rank)
        try:
            globals()[name](rank, world, out)
        except Exception as e:
            print(f"RANK{rank} {name} {type(e).__name__}: {e}", flush=True)
            rc = 3
    os._exit(rc)  # skip process-group teardown (a dead peer would make it wait)


if __name__ == "__main__":
    main()
