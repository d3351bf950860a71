"""``export_hf``: a maximus model (or engine) out as an ordinary Hugging Face folder.

The folder holds ``config.json``, safetensors weights with every sharded table (embedding, LM head)
materialised in full, and the tokenizer, so ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load it **without ds_maximus installed**. Maximus's own parameters
(the norm carrier) are left out. ``original_order=True`` puts the rows back in the base tokenizer's
order (``new_to_old`` of the token map) and writes the base tokenizer instead of the rewritten one.

Example::

    engine, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ...  # train
    ds_maximus.export_hf(engine, "out/hf", token_map="tokenmap/")   # rewritten tokenizer, new ids
    ds_maximus.export_hf(engine, "out/hf_base", token_map="tokenmap/", original_order=True)

From a DeepSpeed checkpoint folder (ZeRO 0-3), without building the model::

    maximus-export ckpt/ out/hf --model-config hf_config_dir/ --token-map tokenmap/ [--original-order]

The folder is written to a temporary sibling first and renamed into place: an interrupted export
never leaves a half-written ``out_dir``.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
from typing import Dict, Optional, Tuple, Union

import torch
from torch import nn

from ds_maximus.errors import ConfigError, TokenMapError

logger = logging.getLogger("ds_maximus")
CARRIER_NAME = "maximus_norm_carrier"  # ds_maximus.engine.norm_carrier.CARRIER_NAME (kept importable without DS)
_SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "unk_token_id")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---- the state dict of a live model ----------------------------------------------------------------
def _is_engine(obj) -> bool:
    return isinstance(getattr(obj, "module", None), nn.Module) and hasattr(obj, "save_checkpoint")


def _is_maximus_module(m: nn.Module) -> bool:
    """A module whose table lives outside its Parameters (a ``weight`` Parameter is exported as one)."""
    return (callable(getattr(m, "maximus_state_dict", None)) and callable(getattr(m, "full_weight", None))
            and "weight" not in m._parameters)


def _tied_source(m: nn.Module) -> Optional[nn.Module]:
    """The embedding a sharded LM head reads its rows from, if it is tied."""
    src = getattr(m, "tied_to", None)
    if isinstance(src, (list, tuple)):  # ShardedLMHead keeps it in a list so it is not a submodule
        src = src[0] if src else None
    return src if isinstance(src, nn.Module) else None


def _gathered(params):
    """Context that gathers ZeRO-3 partitioned ``params`` (no-op for ordinary ones)."""
    part = [p for p in params if hasattr(p, "ds_id")]
    if not part:
        return contextlib.nullcontext()
    import deepspeed
    return deepspeed.zero.GatheredParameters(part, modifier_rank=None)


def model_state_dict(model: nn.Module) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Plain CPU state dict of ``model``: sharded tables in full, ZeRO-3 params gathered, carrier dropped.

    Returns ``(state_dict, tied)`` where ``tied`` maps a sharded head's module name to the embedding
    module name it shares rows with (its weight is then not in the state dict).
    """
    sd: Dict[str, torch.Tensor] = {}
    tied: Dict[str, str] = {}
    names = {id(m): n for n, m in model.named_modules()}
    for name, m in model.named_modules():
        if not _is_maximus_module(m):
            continue
        prefix = f"{name}." if name else ""
        src = _tied_source(m)
        if src is not None:
            tied[name] = names.get(id(src), "")
        else:
            sd[prefix + "weight"] = m.full_weight().detach().to("cpu").clone()
        bias = getattr(m, "bias", None)
        if isinstance(bias, torch.Tensor):
            with _gathered([bias]):
                sd[prefix + "bias"] = bias.detach().to("cpu").clone()
    for name, p in model.named_parameters():
        if name.split(".")[-1] == CARRIER_NAME or name in sd:
            continue  # the carrier is maximus-internal; a sharded module's weight is materialised above
        with _gathered([p]):
            sd[name] = p.detach().to("cpu").clone()
    for mod_name, m in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for bname, b in m.named_buffers(recurse=False):
            if b is not None and bname not in m._non_persistent_buffers_set:
                sd[prefix + bname] = b.detach().to("cpu").clone()
    return sd, tied


# ---- a DeepSpeed checkpoint folder -------------------------------------------------------------------
def _resolve_tag(ckpt_dir: str, tag: Optional[str]) -> str:
    if tag is not None:
        return str(tag)
    from ds_maximus.engine.zero_to_fp32 import latest_tag
    found = latest_tag(ckpt_dir)
    if found is None:
        raise ConfigError(f"{ckpt_dir} has no 'latest' file naming the checkpoint tag; pass the tag "
                          f"(--tag global_stepN), one of {sorted(_tags(ckpt_dir))}")
    return found


def _tags(ckpt_dir: str):
    return [d for d in os.listdir(ckpt_dir) if os.path.isdir(os.path.join(ckpt_dir, d))]


def _dense_from_checkpoint(ckpt_dir: str, tag: str, trust: bool = False) -> Dict[str, torch.Tensor]:
    """Dense parameters (fp32) and buffers of a DeepSpeed checkpoint, any ZeRO stage.

    DeepSpeed's files are read with ``weights_only=True`` and DeepSpeed's allow-list; ``zero_to_fp32``
    loads them itself, so each is checked that way first (see :mod:`ds_maximus.safe_load`)."""
    from ds_maximus.safe_load import check_deepspeed_folder, safe_torch_load
    folder = os.path.join(ckpt_dir, tag)
    if any(f.endswith("optim_states.pt") for f in os.listdir(folder)):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as fp32_state_dict
        check_deepspeed_folder(folder, trust=trust)
        # DeepSpeed's own function, not the wrapper ds_maximus.engine.zero_to_fp32 installs (the caller adds
        # the tables, and has checked the files with its own trust)
        dense = getattr(fp32_state_dict, "__wrapped__", fp32_state_dict)
        sd = dense(ckpt_dir, tag=tag)
    else:  # ZeRO stage 0: the module state dict is stored whole
        files = sorted(f for f in os.listdir(folder) if f.endswith("model_states.pt"))
        if not files:
            raise ConfigError(f"{folder} holds no *model_states.pt: it is not a DeepSpeed checkpoint folder")
        sd = safe_torch_load(os.path.join(folder, files[0]), trust=trust, allow_deepspeed=True)["module"]
    from ds_maximus.engine.zero_to_fp32 import drop_carrier
    return drop_carrier(sd)



def checkpoint_state_dict(ckpt_dir: str, tag: Optional[str] = None,
                          trust_checkpoint: bool = False) -> Dict[str, torch.Tensor]:
    """The plain fp32 state dict of a maximus DeepSpeed checkpoint: dense params from DeepSpeed's files
    (``zero_to_fp32``), sharded tables from ``<ckpt_dir>/<tag>/maximus_states.pt``.

    Every file is read with ``weights_only=True``; one that needs other types raises
    ``UntrustedCheckpointError`` unless ``trust_checkpoint=True`` (for checkpoints you wrote)."""
    tag = _resolve_tag(ckpt_dir, tag)
    folder = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(folder):
        raise ConfigError(f"checkpoint tag {tag!r} not found in {ckpt_dir}; tags there: {sorted(_tags(ckpt_dir))}")
    from ds_maximus.engine.zero_to_fp32 import add_tables
    sd = _dense_from_checkpoint(ckpt_dir, tag, trust_checkpoint)
    add_tables(sd, folder, trust_checkpoint)
    return sd


def find_model_config(ckpt_dir: str, tag: Optional[str], model_config: Optional[str]):
    """The HF config for a checkpoint: ``model_config`` (a folder or config.json), else a config.json
    in ``<ckpt_dir>/<tag>/`` or ``<ckpt_dir>/``."""
    from transformers import AutoConfig
    cands = [model_config] if model_config else [os.path.join(ckpt_dir, tag or ""), ckpt_dir]
    for c in cands:
        if c and (os.path.isfile(os.path.join(c, "config.json")) or os.path.isfile(c)):
            if os.path.isfile(c):
                return AutoConfig.from_pretrained(os.path.dirname(c) or ".")
            return AutoConfig.from_pretrained(c)
    raise ConfigError(f"no model config for {ckpt_dir}: looked for config.json in {cands}; pass --model-config "
                      "DIR (a Hugging Face config folder) or save model.config.save_pretrained(ckpt_dir) beside "
                      "the checkpoint")


# ---- token maps and tokenizers ----------------------------------------------------------------------
def _load_token_map(token_map):
    if token_map is None or hasattr(token_map, "new_to_old"):
        return token_map
    from ds_maximus.tokenmap.token_map import TokenMap
    return TokenMap.load(os.fspath(token_map))


def _write_tokenizer(dst: str, tokenizer, token_map, original_order: bool) -> None:
    if tokenizer is not None:
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer))
        tokenizer.save_pretrained(dst)
        return
    if token_map is None:
        return
    import json

    from ds_maximus.tokenmap.rewrite import permute_tokenizer_json, write_tokenizer_folder
    src = token_map.tokenizer_dir or ""
    if original_order:
        n2o = token_map.new_to_old.tolist()
        write_tokenizer_folder(src, dst, permute_tokenizer_json(token_map.tokenizer_json, n2o), n2o)
    else:
        write_tokenizer_folder(src, dst, token_map.tokenizer_json, list(range(token_map.vocab_size)))
    cfg_path = os.path.join(dst, "tokenizer_config.json")
    if not os.path.isfile(cfg_path):
        with open(cfg_path, "w", encoding="utf-8") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)


def _to_original_order(sd: Dict[str, torch.Tensor], keys, token_map, vocab_rows: int) -> None:
    """Rows ``[0, V_map)`` of each table in ``keys`` back in the base order: ``old[o] = new[old_to_new[o]]``."""
    V = token_map.vocab_size
    if vocab_rows < V:
        raise TokenMapError(f"the token map has {V} ids but the model's vocabulary has {vocab_rows} rows; "
                            "export with the token map the model was trained with")
    o2n = token_map.old_to_new
    for k in keys:
        t = sd[k]
        out = t.clone()
        out[:V] = t[o2n]
        sd[k] = out


def _map_special_ids(cfg, n2o: torch.Tensor) -> None:
    for key in _SPECIAL_ID_KEYS:
        v = getattr(cfg, key, None)
        if isinstance(v, int) and 0 <= v < n2o.numel():
            setattr(cfg, key, int(n2o[v]))
        elif isinstance(v, list):
            setattr(cfg, key, [int(n2o[i]) if isinstance(i, int) and 0 <= i < n2o.numel() else i for i in v])


# ---- writing -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_dir(out_dir: str):
    """Yield a temporary sibling folder; on success it replaces ``out_dir`` (rename), else it is removed."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        for root, _, files in os.walk(tmp):
            for f in files:
                fd = os.open(os.path.join(root, f), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        old = None
        if os.path.exists(out_dir):
            old = f"{out_dir}.old-{os.getpid()}"
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _model_class(config, hint: Optional[type] = None):
    if hint is not None:
        return hint
    import transformers
    for arch in getattr(config, "architectures", None) or []:
        if hasattr(transformers, arch):
            return getattr(transformers, arch)
    return transformers.AutoModelForCausalLM


def _meta_model(cls, config) -> nn.Module:
    """``cls`` (a PreTrainedModel class or an Auto class) built from ``config`` without allocating weights.

    Built with HF's ZeRO-3 switch off: a ZeRO-3 ``HfDeepSpeedConfig`` still alive in the process (a Trainer of an
    earlier run, the engine being exported) would otherwise make ``_from_config`` partition and initialise the
    meta structure, which fails on meta tensors and is not wanted for a skeleton."""
    with _hf_zero3_off(), torch.device("meta"):
        if hasattr(cls, "_from_config"):
            return cls._from_config(config)
        return cls.from_config(config)


@contextlib.contextmanager
def _hf_zero3_off():
    """``transformers.integrations.is_deepspeed_zero3_enabled()`` is false inside, restored after."""
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:
        yield
        return
    ref = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = ref


def _module_name(model: nn.Module, target: Optional[nn.Module]) -> Optional[str]:
    if target is None:
        return None
    return next((n for n, m in model.named_modules() if m is target), None)


def write_hf_folder(sd: Dict[str, torch.Tensor], config, out_dir: str, *, model_class: Optional[type] = None,
                    tokenizer=None, token_map=None, original_order: bool = False,
                    dtype: Optional[torch.dtype] = None, generation_config=None,
                    max_shard_size: Union[int, str] = "5GB") -> str:
    """Write ``sd`` (a plain state dict) with ``config`` as a Hugging Face folder at ``out_dir`` (atomic)."""
    token_map = _load_token_map(token_map)
    if original_order and token_map is None:
        raise TokenMapError("original_order=True needs the token map the model was trained with "
                            "(token_map=... or --token-map DIR): it holds the old<->new id maps")
    config = copy.deepcopy(config)
    cls = _model_class(config, model_class)
    plain = _meta_model(cls, config)
    in_name = _module_name(plain, plain.get_input_embeddings())
    out_mod = plain.get_output_embeddings() if hasattr(plain, "get_output_embeddings") else None
    out_name = _module_name(plain, out_mod)
    in_key, out_key = f"{in_name}.weight", f"{out_name}.weight" if out_name else None
    if in_key not in sd:
        raise ConfigError(f"the weights have no {in_key} (the input embedding of {cls.__name__}); the model "
                          "config does not match the checkpoint: pass the config of the trained model")
    if out_key and out_key not in sd and hasattr(config, "tie_word_embeddings"):
        config.tie_word_embeddings = True  # a tied head shares the sharded table: restore HF's tying
        plain = _meta_model(cls, config)
    if dtype is None:
        fl = [t.dtype for k, t in sd.items() if t.is_floating_point() and k not in (in_key, out_key)]
        dtype = max(set(fl), key=fl.count) if fl else torch.float32
    sd = {k: (t.to(dtype) if t.is_floating_point() else t).contiguous() for k, t in sd.items()}
    if original_order:
        tables = [k for k in (in_key, out_key, f"{out_name}.bias" if out_name else None) if k and k in sd]
        _to_original_order(sd, tables, token_map, sd[in_key].shape[0])
    missing, unexpected = plain.load_state_dict(sd, strict=False, assign=True)
    if hasattr(plain, "tie_weights"):
        # HF's own tying fills the keys the model shares (a tied head, T5's encoder/decoder tables): what is
        # still on the meta device after it is really missing
        plain.tie_weights()
        missing = [k for k, t in plain.state_dict().items() if t.device.type == "meta"]
    if missing or unexpected:
        raise ConfigError(f"the weights do not fit {cls.__name__} built from the model config: missing "
                          f"{sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}; pass the config of the "
                          "trained model (--model-config)")
    plain.config.dtype = dtype
    if generation_config is not None:
        plain.generation_config = copy.deepcopy(generation_config)
    if original_order:  # special-token ids of the config are in the token map's (new) order
        _map_special_ids(plain.config, token_map.new_to_old)
        if getattr(plain, "generation_config", None) is not None:
            _map_special_ids(plain.generation_config, token_map.new_to_old)
    with atomic_dir(out_dir) as tmp:
        plain.save_pretrained(tmp, max_shard_size=max_shard_size, safe_serialization=True)
        _write_tokenizer(tmp, tokenizer, token_map, original_order)
    logger.info("ds_maximus: exported %s (%s, %s order) to %s", cls.__name__, dtype,
                "original" if original_order else "token-map", out_dir)
    return os.path.abspath(out_dir)


def export_hf(engine_or_model, out_dir: str, tokenizer=None, original_order: bool = False, token_map=None,
              dtype: Optional[torch.dtype] = None, max_shard_size: Union[int, str] = "5GB") -> str:
    """Write ``engine_or_model`` (a DeepSpeed engine or an HF model, maximized or not) as a plain HF folder.

    ``tokenizer``: a transformers tokenizer or folder, written as given; by default the token map's
    tokenizer (the rewritten one, or with ``original_order`` the base one rebuilt from it).
    ``token_map``: a ``TokenMap`` or its folder; defaults to ``maximus.embedding.token_map_dir``.
    ``dtype``: of the written weights; default the dtype of the model's dense parameters.
    Returns the absolute path of ``out_dir``. Under torch.distributed every rank must call it (ZeRO-3
    parameters are gathered collectively); rank 0 writes.
    """
    model = engine_or_model.module if _is_engine(engine_or_model) else engine_or_model
    if not hasattr(model, "config"):
        raise ConfigError(f"export_hf needs a Hugging Face model (with .config); got {type(model).__name__}")
    sd, _ = model_state_dict(model)  # every rank: ZeRO-3 gathers are collective
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    if dist and torch.distributed.get_rank() != 0:
        torch.distributed.barrier()
        return os.path.abspath(out_dir)
    if token_map is None:
        dirs = [getattr(getattr(m, "config", None), "token_map_dir", None) for m in model.modules()
                if _is_maximus_module(m)]
        token_map = next((d for d in dirs if d), None)
    try:
        return write_hf_folder(sd, model.config, out_dir, model_class=type(model), tokenizer=tokenizer,
                               token_map=token_map, original_order=original_order, dtype=dtype,
                               generation_config=getattr(model, "generation_config", None),
                               max_shard_size=max_shard_size)
    finally:
        if dist:
            torch.distributed.barrier()
