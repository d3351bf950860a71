"""#38: does DeepSpeed skip steps (non-finite gradients) in bench_peft_vocab's runs at the Gemma-3-4B shape? Trains
the ``ours`` (capped at 16 GiB) or ``mts`` (plain PEFT, uncapped) model of the bench for ``--steps`` steps as the bench
does and prints each step's loss, DeepSpeed's skipped-step count and the global gradient norm. On the GPU machine,
after ``. .device/env.sh`` and ``. scripts/gpu/common.sh``: ``python scripts/gpu/peft_skipped_steps.py ours auto``."""
import sys
import types

import torch

import benchmarks.bench_peft_vocab as bench


def main() -> None:
    variant, reuse = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "auto")
    steps = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3].isdigit() else 5
    ours = variant == "ours"
    shape = dict(bench.SHAPES["gemma3_small" if "--small" in sys.argv else "gemma3_4b"])
    if ours and torch.cuda.is_available():
        from benchmarks.harness import cap_gpu
        cap_gpu(16.0)
    model = bench._build(shape, torch.bfloat16, False, False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = bench._peft(model, shape, variant, 2048)
    params = [p for p in model.parameters() if p.requires_grad]
    a = types.SimpleNamespace(lr=1e-4, bucket_elems=50_000_000, cache_rows=16384, chunk_rows=8192, reuse_rows=reuse)
    import deepspeed

    import ds_maximus
    init = ds_maximus.initialize if ours else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=params, config=bench._ds_config(a, shape, ours, True, 4))
    data = bench.zipf_batches(shape["vocab"], 4, 2048, steps)
    from ds_maximus.integrations.hf import lookahead
    for i, ids in enumerate(lookahead(data, engine.module) if ours else data):
        loss = bench._train_step(engine, ids)
        print(f"RESULT {variant} reuse={reuse} step {i} loss {loss:.5f} skipped {engine.skipped_steps} "
              f"grad norm {engine.get_global_grad_norm()}", flush=True)


if __name__ == "__main__":
    main()
