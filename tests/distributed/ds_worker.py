"""One rank of the shard-mode tests under the ``deepspeed`` launcher: trains a tiny Llama per mode.

    deepspeed --num_gpus 2 tests/distributed/ds_worker.py --out /tmp/r.pt --modes replicated,partitioned
    ... --modes partitioned --save-at 10 --ckpt /tmp/ck            (save after step 10, go on to the end)
    ... --modes replicated --resume /tmp/ck --save-at 10   (then a partitioned run: load step 10, train on)
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes", default="partitioned")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--resume-stage", type=int, default=0)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    # no deepspeed.init_distributed() here: ds_maximus.initialize must set up the process group (and each
    # rank's GPU) itself before it builds a partitioned or broadcast table, as in a script written for plain
    # deepspeed.initialize
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from ds_maximus.distributed.partitioned_embedding import PartitionedEmbedding
    from tests.engine.llama_utils import build, embedding_weight, maximus_section
    from tests.helpers.models import train_rank_slices, zipf_batches
    batches = zipf_batches(args.steps, batch=args.global_batch, seqlen=16)
    per = args.global_batch // world
    results = {}
    runs = [(m, m, args.stage, None) for m in args.modes.split(",") if m]
    if args.resume:  # after the modes: a partitioned run resumed from a checkpoint (another world size)
        runs.append(("resume", "partitioned", args.resume_stage, args.resume))
    for key, mode, stage, resume in runs:
        sec = maximus_section(cache_rows=96)
        sec["distributed"] = {"shard_mode": mode, "master_rank": 0, "timeout_s": 120}
        # broadcast: the other ranks start from another table, which the master's broadcast must replace
        seed = 0 if mode != "broadcast" or rank == 0 else 7
        if resume:
            seed = 123  # every state must come from the checkpoint
        engine = build(stage, "fp32", micro=per, clip=0.5, maximus=sec, seed=seed)
        start = 0
        if resume:
            path, _ = engine.load_checkpoint(resume, tag=f"step{args.save_at}")
            assert path is not None
            start = engine.maximus.steps

        def save(i, engine=engine, resume=resume):
            if args.save_at and i + 1 == args.save_at and args.ckpt and not resume:
                engine.save_checkpoint(args.ckpt, tag=f"step{args.save_at}")

        losses = train_rank_slices(engine, batches, rank, world, start=start, after_step=save)
        emb = engine.module.model.embed_tokens
        w = embedding_weight(engine)  # collective in partitioned mode
        dev = engine.device  # NCCL (GPU ranks) gathers device tensors only
        sizes = [torch.zeros(1, dtype=torch.float64, device=dev) for _ in range(world)]
        own = float(emb.tier_bytes()) if isinstance(emb, PartitionedEmbedding) else -1.0  # broadcast: a subclass
        torch.distributed.all_gather(sizes, torch.tensor([own], dtype=torch.float64, device=dev))
        results[key] = {"losses": losses, "embedding": w, "tier_bytes": [float(s) for s in sizes],
                        "stats": dict(emb.stats()), "steps": engine.maximus.steps, "start": start}
    if rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
    from tests.distributed.ranks import end_rank
    end_rank()
