"""``ds_maximus.initialize`` is ``deepspeed.initialize`` wherever maximus is off, takes the config every way
DeepSpeed does, refuses a misspelled section with a "did you mean", and says what it swapped and left alone."""
import argparse
import json

import deepspeed
import pytest
import torch

import ds_maximus
from ds_maximus.config import MaximusConfig
from ds_maximus.errors import ConfigError
from tests.engine.llama_utils import maximus_section
from tests.helpers.models import LLAMA_VOCAB as VOCAB
from tests.helpers.models import ds_config, tiny_llama, train, zipf_batches


def _args(path=None):
    return argparse.Namespace(deepspeed_config=path, local_rank=0)


def _write(tmp_path, cfg):
    p = tmp_path / "ds_config.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def _losses(fn, **kw):
    model = tiny_llama(0)
    engine, *_ = fn(model=model, model_parameters=model.parameters(), **kw)
    return engine, train(engine, zipf_batches(3, 2, 8))


@pytest.fixture(scope="module")
def plain_losses():
    return _losses(deepspeed.initialize, config=ds_config(0))[1]


@pytest.mark.parametrize("how", ["args", "config", "config_params", "args_path_config_none"])
@pytest.mark.parametrize("section", ["none", "disabled"])
def test_off_is_plain_deepspeed(tmp_path, plain_losses, how, section):
    """No section or ``"enabled": false``, the config through args, config= or config_params=: the losses are
    plain DeepSpeed's, bit for bit (this used to stop in DeepSpeed's "given deepspeed configs in the
    deepspeed arguments and deepspeed.initialize() function call" assertion)."""
    cfg = ds_config(0) if section == "none" else ds_config(0, maximus={"enabled": False, "embedding": {}})
    path = _write(tmp_path, cfg)
    kw = {"args": dict(args=_args(path)), "config": dict(config=cfg), "config_params": dict(config_params=path),
          "args_path_config_none": dict(args=_args(path), config=None)}[how]
    engine, losses = _losses(ds_maximus.initialize, **kw)
    assert getattr(engine, "maximus", None) is None
    assert losses == plain_losses


def test_on_through_args_deepspeed_config(tmp_path):
    """A maximus section given only through ``--deepspeed_config`` (a script's argparse args) switches it on."""
    path = _write(tmp_path, ds_config(0, maximus=maximus_section(cache_rows=64)))
    args = _args(path)
    engine, losses = _losses(ds_maximus.initialize, args=args)
    assert engine.maximus.steps == 3 and all(x == x for x in losses)
    assert args.deepspeed_config == path  # the caller's args are left as they were


def test_config_twice_is_a_config_error(tmp_path):
    """DeepSpeed refuses a config in both args and config= (AssertionError); maximus says which to drop."""
    cfg = ds_config(0, maximus=maximus_section())
    model = tiny_llama(0)
    with pytest.raises(ConfigError, match="given twice.*drop config="):
        ds_maximus.initialize(args=_args(_write(tmp_path, cfg)), model=model, model_parameters=model.parameters(),
                              config=cfg)


def test_missing_config_file_is_a_config_error(tmp_path):
    model = tiny_llama(0)
    with pytest.raises(ConfigError, match="no file"):
        ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=str(tmp_path / "nope.json"))


@pytest.mark.parametrize("key", ["maximsu", "Maximus", "maximus_", "MAXIMUS"])
def test_near_miss_section_name(key):
    cfg = ds_config(0)
    cfg[key] = {"embedding": {}}
    with pytest.raises(ConfigError, match="did you mean 'maximus'") as e:
        MaximusConfig.from_ds_config(cfg)
    assert e.value.key_path == key
    model = tiny_llama(0)
    with pytest.raises(ConfigError, match=f"\"{key}\""):
        ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=cfg)


def test_unrelated_top_level_keys_pass():
    cfg = ds_config(0)
    cfg.update({"amp": {"enabled": False}, "timers": {}, "comms_logger": {"enabled": False}})
    assert not MaximusConfig.from_ds_config(cfg).enabled


def test_logs_what_it_swapped_and_left_alone(capfd):
    """One rank-0 line per swapped module (name, rows, dim, tier, cache rows) and one per embedding left
    alone with the reason, naming min_rows and how to include it."""
    model = tiny_llama(0)
    engine, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(),
                                       config=ds_config(0, maximus=maximus_section(cache_rows=64)))
    out = capfd.readouterr()
    text = out.out + out.err
    assert (f"ds_maximus: model.embed_tokens -> ShardedEmbedding: {VOCAB} rows x 32, tier cpu (pinned), "
            "GPU cache 64 rows") in text

    model = tiny_llama(0)
    engine, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(),
                                       config=ds_config(0, maximus={"embedding": {"gpu_cache_rows": 64}}))
    text = "".join(capfd.readouterr())
    assert getattr(engine, "maximus", None) is None  # nothing qualified: plain DeepSpeed, but not in silence
    assert (f"ds_maximus: left alone: model.embed_tokens ({VOCAB} rows x 32): {VOCAB} rows < "
            f"embedding.min_rows=32768; set \"min_rows\": {VOCAB}") in text
    assert isinstance(engine.module.model.embed_tokens, torch.nn.Embedding)


def test_logs_the_streamed_head(capfd):
    model = tiny_llama(0)
    sec = maximus_section(cache_rows=64)
    sec["lm_head"] = {"enabled": True, "chunk_rows": 128}
    ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=ds_config(0, maximus=sec))
    text = "".join(capfd.readouterr())
    assert f"ds_maximus: lm_head (Linear, {VOCAB} rows x 32): loss streamed 128 rows a chunk" in text


def _grouped_optimizer_and_scheduler(model):
    """What accelerate's loops and many DeepSpeed scripts build before ``initialize``: AdamW with a decay and a
    no-decay group, and an LR scheduler on it (it counts the groups)."""
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-2)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


@pytest.mark.parametrize("stage", [0, 2])
def test_client_optimizer_groups_and_scheduler_built_before_initialize(stage):
    """A user's scheduler built on a two-group optimizer before ``initialize`` keeps working: the norm carrier joins
    the first group instead of adding a third (which broke the scheduler's step, "zip() argument 2 is shorter than
    argument 1", in DeepSpeed's engine.step and in accelerate's loop), and the losses are plain DeepSpeed's."""
    cfg = ds_config(stage, scheduler=False)
    del cfg["optimizer"]
    runs = {}
    for name, init, section in (("plain", deepspeed.initialize, None),
                                ("ours", ds_maximus.initialize, maximus_section(cache_rows=64))):
        model = tiny_llama(0)
        opt, sched = _grouped_optimizer_and_scheduler(model)
        engine, _, _, engine_sched = init(model=model, optimizer=opt, lr_scheduler=sched,
                                          config=dict(cfg, **({"maximus": section} if section else {})))
        assert engine_sched is sched and len(opt.param_groups) == 2
        runs[name] = (train(engine, zipf_batches(4, 2, 8)), [g["lr"] for g in opt.param_groups])
    assert runs["ours"][1] == runs["plain"][1] == [1e-2 / 5] * 2          # the scheduler stepped 4 times
    torch.testing.assert_close(runs["ours"][0], runs["plain"][0], rtol=1e-5, atol=1e-5)
