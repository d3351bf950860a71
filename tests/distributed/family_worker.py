"""One rank of the families-in-shard-modes test under the ``deepspeed`` launcher: a conformance family whose forward
reads ``embed_tokens.weight`` (Llama-4 its device, Gemma-4 multimodal its pad row) trained with the table cut over the
ranks; rank 0 saves the losses averaged over the ranks.

    deepspeed --num_gpus 2 tests/distributed/family_worker.py --out /tmp/r.pt --family llama4 --mode partitioned
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

STEPS, GLOBAL_BATCH, SEQ = 4, 4, 12


def batches(family):
    from tests.conformance.helpers import zipf_ids
    return zipf_ids(STEPS, GLOBAL_BATCH, SEQ, family.text_ids)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--family", required=True)
    ap.add_argument("--mode", default="partitioned")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    import ds_maximus
    from tests.conformance.families import FAMILIES
    from tests.conformance.helpers import ds_config, maximus_section
    from tests.helpers.models import train_rank_slices
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    family = FAMILIES[args.family]
    torch.manual_seed(0)
    model = family.build()
    sec = maximus_section(family.modules, cache_rows=64)
    sec["distributed"] = {"shard_mode": args.mode, "master_rank": 0, "timeout_s": 120}
    engine, *_ = ds_maximus.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                       config=ds_config(2, maximus=sec, micro=GLOBAL_BATCH // world))
    losses = train_rank_slices(engine, batches(family), rank, world)
    if rank == 0:
        torch.save({"losses": losses}, args.out)


if __name__ == "__main__":
    main()
    from tests.distributed.ranks import end_rank
    end_rank()
