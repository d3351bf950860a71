"""DeepSpeed's own converters on a maximus checkpoint: the ``zero_to_fp32.py`` / ``zero_to_torch.py`` a ZeRO
checkpoint folder holds, run as a user runs them, and ``deepspeed.utils.zero_to_fp32``'s Python functions.

Before ``ds_maximus.engine.zero_to_fp32``, DeepSpeed's script wrote a state dict without the swapped embedding
(and with the engine's norm carrier): a model loaded from it had a random embedding. Now each gives the model's
whole state dict (what ``maximus-export`` reads), which loads strictly into the plain model and gives the engine's
logits."""
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.models import ds_config, tiny_llama, train, zipf_batches


def _checkpoint(stage, tie, path, head=True):
    import ds_maximus
    model = tiny_llama(0, tie=tie)
    cfg = ds_config(stage, scheduler=False, maximus={"embedding": {"min_rows": 1, "gpu_cache_rows": 64},
                                                      "lm_head": {"enabled": head}})
    engine, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    train(engine, zipf_batches(3, 2, 8))
    engine.save_checkpoint(str(path))
    ids = zipf_batches(1, 2, 8, seed=5)[0]
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=ids).logits.float().cpu()   # compared with the plain model on the CPU
    return engine, ids, logits


def _load(out_dir):
    files = [f for f in os.listdir(out_dir) if f.endswith((".bin", ".safetensors"))]
    assert len(files) == 1, files
    path = os.path.join(out_dir, files[0])
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(path)
    return torch.load(path, weights_only=True)


def _check_whole(sd, ids, logits, tie, atol=1e-5):
    """Strict load into the plain model, the engine's logits."""
    assert "model.embed_tokens.weight" in sd and not any("maximus" in k for k in sd)
    model = tiny_llama(1, tie=tie)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    assert not unexpected and missing in ([], ["lm_head.weight"] if tie else [])  # a tied head is the embedding
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits.float(), logits, atol=atol, rtol=0)


@pytest.mark.parametrize("stage,tie", [(2, False), (2, True), (3, False)])
def test_the_checkpoints_zero_to_fp32_script_writes_the_whole_model(stage, tie, tmp_path):
    """``python zero_to_fp32.py . out`` in the checkpoint folder, as DeepSpeed tells users (ZeRO-3 with the head
    streamed also initializes: its wiring line read a ZeRO-3 weight's partitioned shape and failed)."""
    from ds_maximus.integrations.export import checkpoint_state_dict
    ckpt = tmp_path / "ckpt"
    _, ids, logits = _checkpoint(stage, tie, ckpt)
    script = ckpt / "zero_to_fp32.py"
    assert "ds_maximus" in script.read_text()
    r = subprocess.run([sys.executable, str(script), ".", str(tmp_path / "out"), "--safe_serialization"],
                       cwd=ckpt, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    sd = _load(tmp_path / "out")
    want = checkpoint_state_dict(str(ckpt))
    assert sorted(sd) == sorted(want) and all(torch.equal(sd[k], want[k].float()) for k in sd)
    _check_whole(sd, ids, logits, tie)


def test_zero_to_torch_beside_it_converts_to_bf16(tmp_path):
    """DeepSpeed's ``zero_to_torch.py --dtype`` imports the ``zero_to_fp32.py`` beside it: whole too."""
    ckpt = tmp_path / "ckpt"
    _, ids, logits = _checkpoint(2, False, ckpt)
    r = subprocess.run([sys.executable, "zero_to_torch.py", ".", str(tmp_path / "out"), "--dtype", "bf16"],
                       cwd=ckpt, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    sd = _load(tmp_path / "out")
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    _check_whole(sd, ids, logits, False, atol=0.1)


def test_deepspeeds_python_functions_after_initialize(tmp_path):
    """``get_fp32_state_dict_from_zero_checkpoint`` and ``convert_zero_checkpoint_to_fp32_state_dict`` in the
    process that trained (the wrapper is installed by ``initialize``); a plain DeepSpeed checkpoint passes through
    them unchanged."""
    import deepspeed
    from deepspeed.utils import zero_to_fp32 as z
    ckpt = tmp_path / "ckpt"
    _, ids, logits = _checkpoint(2, False, ckpt, head=False)
    _check_whole(z.get_fp32_state_dict_from_zero_checkpoint(str(ckpt)), ids, logits, False)
    z.convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(tmp_path / "out"), max_shard_size=None)
    _check_whole(_load(tmp_path / "out"), ids, logits, False)

    model = tiny_llama(0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(2, scheduler=False))
    train(engine, zipf_batches(2, 2, 8))
    engine.save_checkpoint(str(tmp_path / "plain"))
    sd = z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "plain"))
    assert sorted(sd) == sorted(k for k, _ in model.named_parameters())
    assert "ds_maximus" not in (tmp_path / "plain" / "zero_to_fp32.py").read_text()
