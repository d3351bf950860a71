"""One rank of the shard-mode combination tests: runs a list of training configurations in sequence.

Started by the ``deepspeed`` launcher (``tests/distributed/test_combinations.py``), or called in-process with one
rank for the references (:func:`run_config`). One launch runs many configurations: start-up (imports, the
process group) costs more than a tiny model's steps on the 2-core CI machine.

    deepspeed --num_gpus 2 tests/distributed/combo_worker.py --spec /tmp/spec.json --out /tmp/r.pt

A configuration (a dict in the spec's list) names: ``key``, ``model`` (``llama`` or ``mixtral``), ``mode``
(shard mode), ``stage`` (ZeRO), ``gas``, ``tie`` (tied head), ``steps``, ``batch`` (global batch per optimizer
step), ``prefetch`` (iterate through :func:`ds_maximus.integrations.hf.lookahead`), ``save_at``/``save_dir``
(checkpoint after that step), ``resume_dir``/``resume_tag`` (load it first and train on), ``expect_error``
(the resume must fail: the error's type and message are recorded), ``head`` (``"streamed"``: the ``lm_head``
section's CPU tier, ``placement: cpu``, streams the loss chunk by chunk; else the model's own head), ``peft``
(the model wrapped by ``peft.get_peft_model``: LoRA on the blocks, ``modules_to_save=["embed_tokens", "lm_head"]``,
the trained embedding copy swapped; with ``tie``, ``ensure_weight_tying`` keeps one trained copy that the head
reads; after training ``ds_maximus.save_peft`` writes the adapter, whose tensors rank 0 records).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SEQLEN = 16
PER_RANK = ("hit_rate", "stall_ms", "owner_hit_rate", "owner_serve_ms", "table_bytes")  # each rank's, gathered
PEFT_EMB = "base_model.model.model.embed_tokens"   # PEFT's wrapper of the table, and of the head
PEFT_HEAD = "base_model.model.lm_head"


def _data(c: dict):
    if c.get("model", "llama") == "mixtral":
        from tests.experts.training.moe_utils import VOCAB
    else:
        from tests.engine.llama_utils import VOCAB
    from tests.engine.llama_utils import zipf_batches
    return zipf_batches(c["steps"], batch=c["batch"], seqlen=SEQLEN, vocab=VOCAB)


def _section(c: dict) -> dict:
    from tests.engine.llama_utils import maximus_section
    sec = maximus_section(cache_rows=c.get("cache_rows", 96))
    if c.get("model", "llama") == "mixtral":
        from tests.experts.training.moe_utils import moe_section
        sec = {**moe_section(slots=3), "embedding": sec["embedding"]}
    sec["distributed"] = {"shard_mode": c["mode"], "master_rank": c.get("master_rank", 0), "timeout_s": 120}
    if c.get("peft"):  # the trained copy inside PEFT's wrapper, found by size (the frozen original is skipped)
        from tests.engine.llama_utils import VOCAB
        sec["embedding"] = {**sec["embedding"], "modules": [], "min_rows": VOCAB}
    if c.get("head") == "streamed":
        sec["lm_head"] = {"enabled": True, "placement": "cpu", "chunk_rows": 128}
    return sec


def _peft(model, tie: bool):
    """LoRA on attention and MLP projections (B != 0: it trains from the first step), both tables trained in full
    (a tied model: one trained copy, ``ensure_weight_tying``)."""
    import warnings

    from peft import LoraConfig, get_peft_model
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                     modules_to_save=["embed_tokens"] if tie else ["embed_tokens", "lm_head"],
                     ensure_weight_tying=tie, init_lora_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # PEFT's warning about untying a tied model
        return get_peft_model(model, cfg)


def _table(engine):
    """The swapped embedding (inside PEFT's wrapper for a PEFT model)."""
    m = engine.module
    return m.get_submodule(PEFT_EMB).modules_to_save["default"] if hasattr(m, "peft_config") else m.model.embed_tokens


def _head(engine):
    m = engine.module
    return m.get_submodule(PEFT_HEAD).modules_to_save["default"] if hasattr(m, "peft_config") else m.lm_head


def _engine(c: dict, micro: int, seed: int, scramble_table: bool = False):
    import ds_maximus
    from tests.engine.llama_utils import ds_config, tiny_llama
    if c.get("model", "llama") == "mixtral":
        from tests.experts.training.moe_utils import tiny_mixtral
        model = tiny_mixtral(seed=seed, num_experts=8)
    else:
        model = tiny_llama(seed, tie=c.get("tie", False))
    if scramble_table:
        with torch.no_grad():
            model.model.embed_tokens.weight.normal_(generator=torch.Generator().manual_seed(7))
    if c.get("peft"):
        model = _peft(model, c.get("tie", False))
    cfg = ds_config(c["stage"], "fp32", gas=c["gas"], micro=micro, clip=0.5, maximus=_section(c))
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = ds_maximus.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def _dense(engine) -> dict:
    """A few dense parameters (fp32 CPU; gathered under ZeRO-3, a collective)."""
    import deepspeed
    names = ("model.norm.weight", "model.layers.1.self_attn.o_proj.weight", "lm_head.weight")
    params = dict(engine.module.named_parameters())
    if hasattr(engine.module, "peft_config"):  # the trained ones: LoRA weights and the head's trained copy
        names = tuple(n for n, p in params.items() if p.requires_grad and "maximus_" not in n)
    out = {}
    for n in names:
        p = params.get(n)
        if p is None:
            continue
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            out[n] = p.detach().float().cpu().clone()
    head = _head(engine)
    if getattr(head, "owns_weights", False):  # a CPU-tier head: its rows are no parameter
        out["lm_head.weight"] = head.full_weight().float().cpu().clone()
    moe = getattr(engine, "maximus", None) and engine.maximus.modules.get("moe")
    if moe is not None:
        for g in range(moe.num_layers):
            for k, t in moe.expert_tensors(g).items():
                out[f"experts.{g}.{k}"] = t.float().cpu().clone()
    return out


def _saved_adapter(engine, rank: int) -> dict:
    """``ds_maximus.save_peft``'s adapter tensors (every rank takes part: whole tables are gathered; rank 0 writes
    and reads them back)."""
    import tempfile

    from safetensors.torch import load_file

    import ds_maximus
    with tempfile.TemporaryDirectory() as d:
        ds_maximus.save_peft(engine, d)
        return load_file(os.path.join(d, "adapter_model.safetensors")) if rank == 0 else {}


def run_config(c: dict, rank: int, world: int) -> dict:
    """Train configuration ``c`` on this rank; returns losses per optimizer step, the table and dense params."""
    from ds_maximus.integrations.hf import lookahead
    gas = c["gas"]
    micro = c["batch"] // (world * gas)
    assert micro * world * gas == c["batch"], (c, world)
    # a resumed run starts from another model, which the checkpoint must replace; in broadcast mode the other
    # ranks start from another table, which the master's broadcast must replace
    seed = 123 if c.get("resume_dir") else 0
    scramble = c["mode"] == "broadcast" and rank != c.get("master_rank", 0)
    engine = _engine(c, micro, seed, scramble)
    start = 0
    if c.get("resume_dir"):
        try:
            engine.load_checkpoint(c["resume_dir"], tag=c.get("resume_tag"))
        except Exception as e:  # recorded: the test checks the type and the message
            if not c.get("expect_error"):
                raise
            return {"error": type(e).__name__, "message": str(e), "mro": [k.__name__ for k in type(e).__mro__]}
        start = engine.maximus.steps
    data = _data(c)
    micro_batches = [{"input_ids": data[i].view(gas, world, micro, SEQLEN)[k, rank]}
                     for i in range(start, c["steps"]) for k in range(gas)]
    it = lookahead(micro_batches, engine.module) if c.get("prefetch") else micro_batches
    losses, acc = [], 0.0
    for j, b in enumerate(it):
        ids = b["input_ids"].to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        acc += float(loss.detach()) / gas
        if (j + 1) % gas == 0:
            t = torch.tensor([acc / world], dtype=torch.float64, device=engine.device)
            if world > 1:
                torch.distributed.all_reduce(t)
            losses.append(float(t))
            acc = 0.0
            step = start + len(losses)
            if c.get("save_at") == step and c.get("save_dir"):
                engine.save_checkpoint(c["save_dir"], tag=f"step{step}")
    emb = _table(engine)
    stats = dict(emb.stats())
    out = {"losses": losses, "embedding": emb.full_weight().float().cpu(), "dense": _dense(engine),
           "start": start, "steps": engine.maximus.steps, "stats": stats, "type": type(emb).__name__,
           "head": type(_head(engine)).__name__, "head_placement": getattr(_head(engine), "placement", None)}
    if c.get("peft"):
        out["adapter"] = _saved_adapter(engine, rank)
    if world > 1:  # every rank's hit rate and stall (rank 0 writes the results)
        per = torch.tensor([stats.get(k, -1.0) for k in PER_RANK], dtype=torch.float64, device=engine.device)
        got = [torch.zeros_like(per) for _ in range(world)]
        torch.distributed.all_gather(got, per)
        out["per_rank"] = [dict(zip(PER_RANK, g.cpu().tolist())) for g in got]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    # no deepspeed.init_distributed() here: ds_maximus.initialize sets the process group up itself
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(args.spec) as f:
        spec = json.load(f)
    results = {}
    for c in spec:
        results[c["key"]] = run_config(c, rank, world)
        if rank == 0:  # after each configuration: a later failure keeps the earlier results
            torch.save(results, args.out)
    # what each rank saw of the launch (the multi-node simulation checks it), and the group the tables used
    from ds_maximus.distributed.collectives import default_group
    seen = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "LOCAL_SIZE", "WORLD_SIZE", "CROSS_RANK",
                                           "CROSS_SIZE")}
    seen["dp_group_size"] = torch.distributed.get_world_size(default_group())
    envs = [None] * world
    torch.distributed.all_gather_object(envs, seen)
    if rank == 0:
        results["_env"] = envs
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
    from tests.distributed.ranks import end_rank
    end_rank(barrier=True)
