"""Worker for the data-parallel tests: trains a tiny Llama with maximus (or plain) and writes the result.

    deepspeed --num_gpus 2 tests/engine/dp_worker.py --out /tmp/r.pt --micro 2 --stage 2
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    import deepspeed
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    from tests.engine.llama_utils import build, embedding_weight, maximus_section
    from tests.helpers.models import train_rank_slices, zipf_batches
    # the same global batches whatever the world size; each rank takes its slice
    batches = zipf_batches(args.steps, batch=args.global_batch, seqlen=16)
    per = args.global_batch // world
    engine = build(args.stage, "fp32", micro=per, clip=0.5,
                   maximus=None if args.plain else maximus_section(cache_rows=96))
    losses = train_rank_slices(engine, batches, rank, world)
    w = embedding_weight(engine)
    if rank == 0:
        torch.save({"losses": losses, "embedding": w}, args.out)


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # an exit with a live gloo group can abort in teardown (rc -6)
        torch.distributed.destroy_process_group()
