"""``ds_maximus.initialize``: a drop-in for ``deepspeed.initialize`` that honours the ``"maximus"`` section.

Example::

    engine, optimizer, _, scheduler = ds_maximus.initialize(
        model=model, model_parameters=model.parameters(), config="ds_configs/zero2_cpu_tier.json")
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()          # dense step by DeepSpeed, sparse step by maximus

``ds_maximus.enable()`` makes every later ``deepspeed.initialize`` call (HF Trainer through accelerate
included) go through here.
"""
from __future__ import annotations

import copy
import logging
import os
from typing import Any, Optional

import deepspeed
import torch

from ds_maximus.config import SECTION, ExpertOptimizerDevice, MaximusConfig
from ds_maximus.distributed import shm_buffers as _shm_buffers
from ds_maximus.engine import adapters
from ds_maximus.engine.protocol import MaximusModule, ModuleRole
from ds_maximus.engine.swap import remove_params_from_optimizer, swap_embeddings
from ds_maximus.errors import ConfigError

logger = logging.getLogger("ds_maximus")
_DEEPSPEED_INITIALIZE = deepspeed.initialize


def _resolve_config(args, config, config_params):
    """The ds_config as ``deepspeed.initialize`` finds it, loaded into a dict (``None`` where none is given).

    DeepSpeed's rules: ``config`` (else ``config_params``) or ``args.deepspeed_config`` (else the deprecated
    ``args.deepscale_config``), exactly one of them; a path (JSON/hjson) or a base64 string is loaded. Where
    DeepSpeed would stop with an ``AssertionError``, this stops with a ``ConfigError`` that says which to drop.
    """
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    scale = getattr(args, "deepscale_config", None)
    if scale is not None:
        if from_args is not None:
            raise ConfigError("args has both deepscale_config and deepspeed_config; deepscale_config is the deprecated "
                              "name of deepspeed_config: pass only --deepspeed_config")
        from_args = scale
    if from_args is not None:
        if config is not None:
            raise ConfigError("a ds_config was given twice: in args.deepspeed_config (--deepspeed_config) and in the "
                              "config= argument of initialize; DeepSpeed accepts one of them: drop config= or set "
                              "args.deepspeed_config = None")
        config = from_args
    if config is None or isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
        try:
            return load_ds_config(os.fspath(config))
        except ValueError as e:
            what = "is not valid JSON" if os.path.exists(config) else "is no file and no base64-encoded JSON string"
            raise ConfigError(f"ds_config {os.fspath(config)!r} {what} ({e}); pass the path of a JSON file or a "
                              "dict") from None
    return config  # a DeepSpeedConfig-like object: MaximusConfig reads its raw dict


def _without_config_args(args):
    """``args`` with its ds_config fields cleared: the resolved dict goes to DeepSpeed as ``config``."""
    if args is None or (getattr(args, "deepspeed_config", None) is None
                        and getattr(args, "deepscale_config", None) is None):
        return args
    args = copy.copy(args)
    for name in ("deepspeed_config", "deepscale_config"):
        if hasattr(args, name):
            setattr(args, name, None)
    return args


def initialize(args: Any = None, model: Optional[torch.nn.Module] = None, optimizer=None, model_parameters=None,
               config=None, config_params=None, **kwargs):
    """Same arguments, rules and return tuple as ``deepspeed.initialize``; without a ``"maximus"`` section (or
    with ``"enabled": false``) it is ``deepspeed.initialize``."""
    ds_config = _resolve_config(args, config, config_params)
    cfg = MaximusConfig.from_ds_config(ds_config)
    _shm_buffers.remove_at_exit()
    if not cfg.enabled or model is None:
        if not isinstance(ds_config, dict) or SECTION not in ds_config:  # untouched: DeepSpeed sees what it was given
            return _DEEPSPEED_INITIALIZE(args=args, model=model, optimizer=optimizer,
                                         model_parameters=model_parameters, config=config,
                                         config_params=config_params, **kwargs)
        return _DEEPSPEED_INITIALIZE(args=_without_config_args(args), model=model, optimizer=optimizer,
                                     model_parameters=model_parameters,
                                     config={k: v for k, v in ds_config.items() if k != SECTION}, **kwargs)
    from ds_maximus.distributed.cores import share_host_cores
    share_host_cores()
    _init_distributed(cfg, kwargs)
    plan = swap_embeddings(model, cfg)
    modules = dict(plan.swapped)
    if cfg.lm_head.enabled:  # the model family's adapter (registered by its integration) patches the loss
        head = adapters.attach_lm_head(model, cfg)
        if isinstance(head, MaximusModule) and head.engine_driven:
            modules["lm_head"] = head
    if cfg.moe.enabled and cfg.moe.train:  # experts become a runtime module; their params leave the model
        from ds_maximus.experts.training import attach_expert_training
        modules["moe"] = attach_expert_training(model, cfg)
    if modules:   # the integrations' last word on the swapped model (PEFT's frozen originals to host memory)
        adapters.prepare_model(model, cfg)
    # the replaced head's weight (placement cpu) and the trained experts leave the model like the embedding's
    removed = list(plan.removed_params)
    for m in modules.values():
        removed += list(m.removed_params)
    if isinstance(optimizer, torch.optim.Optimizer) and removed:
        remove_params_from_optimizer(optimizer, removed)
    # parameters that left the model must not reach DeepSpeed either
    if model_parameters is not None:
        gone = {id(p) for p in removed}
        model_parameters = _filter_params(model_parameters, gone)
    runtime = None
    if modules:
        from ds_maximus.engine.norm_carrier import attach_carrier
        from ds_maximus.engine.runtime import MaximusRuntime
        runtime = MaximusRuntime(None, modules, cfg)
        # the embedding runs last in backward: it carries the norm of every module's sparse grads
        # (else the experts' layer-0 module: every layer's backward feeds its anchor)
        hosts = runtime.of_role(ModuleRole.ROWS) or runtime.of_role(ModuleRole.EXPERTS) or list(modules.values())
        carrier = attach_carrier(hosts[0].grad_anchor_host(), runtime)
        # into the first group, not a group of its own: an LR scheduler the user built on this optimizer before
        # initialize (accelerate's loop: get_scheduler, then prepare) counts its groups, and a group more breaks
        # its step. The carrier's value is never read, so that group's lr and decay do not matter.
        if model_parameters is not None:
            model_parameters = _add_param(model_parameters, carrier)
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer.param_groups[0]["params"].append(carrier)
    from deepspeed.accelerator import get_accelerator
    rows_on_gpu = bool(plan.swapped) and get_accelerator().device_name() == "cuda"
    ds_config = _unsynchronized_throughput_timer({k: v for k, v in ds_config.items() if k != SECTION}, cfg,
                                                 rows_on_gpu)
    engine, opt, loader, sched = _DEEPSPEED_INITIALIZE(args=_without_config_args(args), model=model,
                                                       optimizer=optimizer, model_parameters=model_parameters,
                                                       config=ds_config, **kwargs)
    if runtime is not None:
        from ds_maximus.engine.zero_to_fp32 import install
        install()  # DeepSpeed's zero_to_fp32 functions then convert this engine's checkpoints whole
        from ds_maximus.engine.lookahead import wrap_loader
        loader = wrap_loader(loader, plan.swapped.values())
        runtime.engine = engine
        for m in modules.values():
            m.configure_from_engine(engine, cfg)
        runtime.install()
        from ds_maximus.engine.consolidated_state import own_keys_consolidated_state_dict
        own_keys_consolidated_state_dict(engine)
        from ds_maximus.observability import register
        register(model, runtime)
    from ds_maximus.engine.wiring_report import log_wiring
    log_wiring(model, modules, plan.tied_heads, cfg)
    return engine, opt, loader, sched


def _unsynchronized_throughput_timer(ds_config: dict, cfg: MaximusConfig, rows_on_gpu: bool = False) -> dict:
    """DeepSpeed's throughput timer synchronizes the device at every forward's start (``timers.throughput.
    synchronized``, default true, when ``initialize`` gets no training data). That would wait for an expert
    step meant to overlap the forward (``moe.overlap_step``), and for the step of vocabulary rows outside the
    cache (``rows_on_gpu``: swapped tables on a GPU; a tied head's gradient reaches every row), which runs on
    side streams into the next forward; so it is turned off then, unless set."""
    m = cfg.moe
    experts = m.enabled and m.train and m.overlap_step and m.optimizer_device == ExpertOptimizerDevice.SPLIT
    if not (experts or rows_on_gpu):
        return ds_config
    timers = dict(ds_config.get("timers") or {})
    tp = dict(timers.get("throughput") or {})
    if "synchronized" in tp:
        return ds_config
    tp["synchronized"] = False
    logger.info("ds_maximus: timers.throughput.synchronized set false (a device sync at every forward would wait "
                "for the %s step that runs on into it)", "expert" if experts else "vocabulary rows'")
    return {**ds_config, "timers": {**timers, "throughput": tp}}


def _init_distributed(cfg: MaximusConfig, kwargs: dict) -> None:
    """What ``deepspeed.initialize`` does first, done before the swap: the partitioned and broadcast tables
    talk to the other ranks while they are built. Also each launched rank's GPU (``LOCAL_RANK``), which the
    engine would set only later: NCCL needs every rank on its own device from the first collective."""
    from ds_maximus.config import ShardMode
    if cfg.distributed.shard_mode == ShardMode.REPLICATED or kwargs.get("dist_init_required") is False:
        return
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    if acc.device_name() != "cpu" and "LOCAL_RANK" in os.environ:
        acc.set_device(int(os.environ["LOCAL_RANK"]))
    if not comm.is_initialized():
        deepspeed.init_distributed(dist_backend=acc.communication_backend_name(),
                                   distributed_port=kwargs.get("distributed_port", 29500))


def _filter_params(params, gone):
    params = list(params)
    if params and isinstance(params[0], dict):
        return [{**g, "params": [p for p in g["params"] if id(p) not in gone]} for g in params]
    return [p for p in params if id(p) not in gone]


def _add_param(params, carrier):
    """``params`` (tensors, or parameter-group dicts) with the carrier added: to the first group where there are
    groups (their count stays the user's; the dicts are copied, not changed)."""
    params = list(params)
    if params and isinstance(params[0], dict):
        first = {**params[0], "params": list(params[0]["params"]) + [carrier]}
        return [first] + params[1:]
    return params + [carrier]


def enable() -> None:
    """Route every later ``deepspeed.initialize`` through ``ds_maximus.initialize`` (HF Trainer, accelerate),
    and run the model adapters' ``on_enable`` hooks: with transformers installed, every later ``Trainer`` then
    logs the maximus figures with its own logs (the Hugging Face adapter's Trainer callback)."""
    deepspeed.initialize = initialize
    from ds_maximus.engine.zero_to_fp32 import install
    install()  # DeepSpeed's zero_to_fp32 functions then convert maximus checkpoints whole
    adapters.run_enable_hooks()


def disable() -> None:
    deepspeed.initialize = _DEEPSPEED_INITIALIZE
    adapters.run_disable_hooks()
