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
