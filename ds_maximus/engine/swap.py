"""Find the embeddings a ``"maximus"`` section asks for and swap them for ``ShardedEmbedding``.

The planner is separate from the engine hooks: it takes a model and the config and returns what it
swapped, so it can be tested without DeepSpeed.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List

import torch
from torch import nn

from ds_maximus.config import MaximusConfig
from ds_maximus.engine.fidelity import embedding_scale
from ds_maximus.errors import ConfigError

logger = logging.getLogger("ds_maximus")


@dataclasses.dataclass
class SwapPlan:
    """What ``swap_embeddings`` did: module name -> new module, and the params that left the model."""

    swapped: Dict[str, nn.Module]
    removed_params: List[nn.Parameter]
    tied_heads: Dict[str, str]  # head module name -> embedding module name


def _parent(model: nn.Module, name: str):
    parts = name.split(".")
    mod = model
    for p in parts[:-1]:
        mod = getattr(mod, p)
    return mod, parts[-1]


def select_embeddings(model: nn.Module, cfg: MaximusConfig) -> List[str]:
    """Names of the ``nn.Embedding`` modules to swap: ``embedding.modules``, or all with >= ``min_rows`` rows."""
    emb_cfg = cfg.embedding
    named = dict(model.named_modules())
    if emb_cfg.modules:
        missing = [n for n in emb_cfg.modules if n not in named]
        if missing:
            candidates = [n for n, m in named.items() if isinstance(m, nn.Embedding)]
            raise ConfigError(f"maximus.embedding.modules names {missing}, which the model does not have; "
                              f"its embeddings are {candidates}", "maximus.embedding.modules")
        from ds_maximus.vocab import ShardedEmbedding
        wrong = [n for n in emb_cfg.modules if not isinstance(named[n], (nn.Embedding, ShardedEmbedding))]
        if wrong:
            raise ConfigError(f"maximus.embedding.modules: {wrong} are not nn.Embedding "
                              f"({[type(named[n]).__name__ for n in wrong]})", "maximus.embedding.modules")
        return list(emb_cfg.modules)
    from ds_maximus.vocab import ShardedEmbedding
    return [n for n, m in named.items()
            if isinstance(m, ShardedEmbedding)
            or (isinstance(m, nn.Embedding) and m.num_embeddings >= emb_cfg.min_rows
                and not bypassed_original(model, n, m))]


def bypassed_original(model: nn.Module, name: str, m: nn.Module) -> bool:
    """A table that a wrapper holds beside the copy its ``.weight`` forwards to (PEFT's ``original_module`` in a
    ModulesToSaveWrapper): the wrapper's forward calls the copy, so the maximus partition is the copy."""
    if "." not in name:
        return False
    parent = model.get_submodule(name.rsplit(".", 1)[0])
    if "weight" in parent._parameters:
        return False
    from ds_maximus.vocab import ShardedEmbedding, plain_weight
    w = plain_weight(parent)
    if isinstance(w, torch.Tensor):
        return w is not m.weight
    # once the copy is swapped the wrapper forwards to a ShardedEmbedding, which has no plain weight
    forwards = type(parent).__getattr__ is not nn.Module.__getattr__
    return forwards and any(isinstance(c, ShardedEmbedding) for c in parent.modules())


def swap_embeddings(model: nn.Module, cfg: MaximusConfig, training: bool = True) -> SwapPlan:
    """Replace the selected embeddings in place; a tied LM head is re-pointed at the sharded table.

    Every module holding the same weight (T5's ``shared``, ``encoder.embed_tokens`` and
    ``decoder.embed_tokens``) becomes the same sharded module, listed once in ``plan.swapped``. An embedding
    subclass's own forward is reproduced or refused (:mod:`ds_maximus.engine.fidelity`). For ``training``, a
    frozen table is refused: maximus would train its rows.
    """
    from ds_maximus.vocab import ShardedEmbedding, plain_weight

    plan = SwapPlan({}, [], {})
    if not (cfg.enabled and cfg.embedding.enabled):
        return plan
    for name in select_embeddings(model, cfg):
        old = dict(model.named_modules(remove_duplicate=False))[name]
        if isinstance(old, ShardedEmbedding) or not isinstance(old, nn.Embedding):
            # already maximized (maximize() before initialize), or an alias of a table swapped above
            if all(m is not old for m in plan.swapped.values()):
                plan.swapped[name] = old
            continue
        if bypassed_original(model, name, old):
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            raise ConfigError(f"maximus.embedding.modules names {name}, which {type(parent).__name__} holds beside the "
                              "copy its forward uses (PEFT modules_to_save: the frozen original); name the trained "
                              f"copy instead ('{name.rsplit('.', 1)[0]}.modules_to_save.default')",
                              "maximus.embedding.modules")
        if training and not old.weight.requires_grad:
            if not cfg.embedding.modules:  # chosen by min_rows: it stays the model's, and the wiring lines say why
                continue
            raise ConfigError(f"{name} is frozen (requires_grad=False; PEFT freezes the base model's weights) and "
                              "maximus trains every row of a table it swaps; leave it out of maximus.embedding "
                              "(embedding.modules, or a min_rows above its rows), or train it (PEFT: "
                              "modules_to_save=['embed_tokens', ...], maximus then swaps the trained copy)",
                              "maximus.embedding.modules")
        scale = embedding_scale(old, name)
        # a wrapper that only forwards ``.weight`` to a module inside it (PEFT's ModulesToSaveWrapper reaches its
        # trained copy this way, for the table and, with ensure_weight_tying, for the tied head) calls that
        # module in forward, so it follows the swap and holds nothing of its own
        holders = [(n, m) for n, m in model.named_modules(remove_duplicate=False)
                   if plain_weight(m) is old.weight]
        owners = [n for n, m in holders if "weight" in m._parameters]
        holders = [(n, m) for n, m in holders
                   if "weight" in m._parameters or not any(o.startswith(n + ".") for o in owners)]
        aliases = [n for n, m in holders if n != name and isinstance(m, nn.Embedding)]
        for n in aliases:
            if type(dict(holders)[n]) is not type(old):
                raise ConfigError(f"{n} shares {name}'s weight but is a {type(dict(holders)[n]).__name__}, not a "
                                  f"{type(old).__name__}; maximus swaps a shared table as one module of one "
                                  "forward, so leave it unswapped", "maximus.embedding.modules")
        heads = [n for n, m in holders if isinstance(m, nn.Linear)]
        others = [n for n, m in holders if n != name and n not in aliases and n not in heads]
        if others:
            kinds = [type(dict(holders)[n]).__name__ for n in others]
            raise ConfigError(f"{name}'s weight is also held by {others} ({kinds}), which maximus cannot re-point "
                              "at a sharded table; leave it unswapped", "maximus.embedding.modules")
        new = _make_sharded(old, cfg)
        if scale is not None:
            scale.attach(new, old)
        carry_hooks(old, new)
        for n in (name, *aliases):
            parent, attr = _parent(model, n)
            setattr(parent, attr, new)
        plan.swapped[name] = new
        plan.removed_params.append(old.weight)
        for hn in heads:
            plan.tied_heads[hn] = name
        logger.debug("ds_maximus: %s (%d x %d)%s -> %s%s%s", name, old.num_embeddings, old.embedding_dim,
                     f" and {aliases}" if aliases else "", type(new).__name__, f", {scale}" if scale else "",
                     f", tied to {heads}" if heads else "")
    if plan.tied_heads:
        _retie_heads(model, plan, cfg)
    if plan.swapped:
        shared = [n for n, m in model.named_modules(remove_duplicate=False)
                  if any(m is s for s in plan.swapped.values())]
        _skip_hf_ties(model, shared + list(plan.tied_heads))
    return plan


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs")


def carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """The forward hooks and pre-hooks registered on ``old`` before ``initialize`` run on its replacement ``new``:
    HF Trainer adds NEFTune's noise to the input embedding's output that way (``neftune_noise_alpha``, registered in
    ``train()`` before DeepSpeed is set up), PEFT's ``enable_input_require_grads`` its ``requires_grad_``. ``new``
    takes ``old``'s hook dicts themselves, so the handles their owners hold still remove them, and its own hooks
    (the embedding scale, which ``old`` computes inside its forward) run before them. The plain attributes such a
    hook reads from its module (``neftune_noise_alpha``) come along."""
    if not any(getattr(old, a) for a in _HOOK_DICTS):
        return
    ours = list(new._forward_hooks.items())
    if any(getattr(new, a) for a in _HOOK_DICTS if a != "_forward_hooks") or any(
            k in new._forward_hooks_with_kwargs or k in new._forward_hooks_always_called for k, _ in ours):
        raise ConfigError(f"{type(new).__name__} has hooks of its own that maximus cannot order before the "
                          f"{type(old).__name__}'s; leave the table unswapped", "maximus.embedding.modules")
    for a in _HOOK_DICTS:
        new.__dict__[a] = getattr(old, a)
    for key, fn in reversed(ours):
        new._forward_hooks[key] = fn
        new._forward_hooks.move_to_end(key, last=False)
    for k, v in vars(old).items():
        if not k.startswith("_") and k not in vars(new) and k not in dir(type(new)) \
                and isinstance(v, (bool, int, float, str)):
            setattr(new, k, v)


def _skip_hf_ties(model: nn.Module, names: List[str]) -> None:
    """HF's ``tie_weights()`` (``resize_token_embeddings``, a user's call) leaves the swapped modules alone: a
    shared table is already one module and a tied head reads its rows, so there is no weight Parameter to
    re-tie there (looking for one raised). Ties elsewhere in the model are made as before."""
    orig = getattr(model, "tie_weights", None)
    if orig is None or not isinstance(getattr(model, "all_tied_weights_keys", None), dict) \
            or getattr(orig, "_maximus", False):
        return
    prefixes = tuple(f"{n}." for n in names)

    def tie_weights(missing_keys=None, recompute_mapping=True):
        # the mapping HF computed before the swap (recomputing it looks for the swapped weights and raises)
        saved = model.all_tied_weights_keys
        model.all_tied_weights_keys = {t: s for t, s in saved.items()
                                       if not (t.startswith(prefixes) or s.startswith(prefixes))}
        try:
            return orig(missing_keys=missing_keys, recompute_mapping=False)
        finally:
            model.all_tied_weights_keys = saved

    tie_weights._maximus = True
    model.tie_weights = tie_weights


def _make_sharded(old: nn.Embedding, cfg: MaximusConfig) -> nn.Module:
    """The module for ``distributed.shard_mode``: a partitioned table, or a whole one (replicated / broadcast)."""
    from ds_maximus.config import ShardMode
    from ds_maximus.vocab import ShardedEmbedding
    mode = cfg.distributed.shard_mode
    if mode == ShardMode.PARTITIONED:
        from ds_maximus.distributed.partitioned_embedding import PartitionedEmbedding
        return PartitionedEmbedding.from_embedding(old, cfg)
    if mode == ShardMode.BROADCAST:
        from ds_maximus.distributed.broadcast import broadcast_embedding
        return broadcast_embedding(old, cfg)
    return ShardedEmbedding.from_embedding(old, cfg.embedding)


def _retie_heads(model: nn.Module, plan: SwapPlan, cfg: MaximusConfig) -> None:
    """A head tied to a swapped embedding becomes a ShardedLMHead on the same table (its bias, if any, kept:
    an ordinary parameter DeepSpeed trains). ``tie_word_embeddings`` stays as it is: saving writes the tied
    checkpoint (see :mod:`ds_maximus.engine.tied_save`)."""
    from ds_maximus.vocab import ShardedLMHead
    for head_name, emb_name in plan.tied_heads.items():
        parent, attr = _parent(model, head_name)
        old = getattr(parent, attr)
        if type(old).forward is not nn.Linear.forward:
            raise ConfigError(f"{head_name} ({type(old).__module__}.{type(old).__name__}) is tied to {emb_name} "
                              "but overrides nn.Linear.forward, which maximus does not reproduce; leave the "
                              "embedding unswapped (maximus.embedding.modules)", "maximus.embedding.modules")
        emb = plan.swapped[emb_name]
        setattr(parent, attr, ShardedLMHead(tied_to=emb, config=cfg.lm_head, bias=old.bias))
        emb.train_padding_row()


def remove_params_from_optimizer(optimizer: torch.optim.Optimizer, params: List[nn.Parameter]) -> int:
    """Drop ``params`` from a client optimizer's groups (HF Trainer builds it before initialize)."""
    ids = {id(p) for p in params}
    removed = 0
    for group in optimizer.param_groups:
        keep = [p for p in group["params"] if id(p) not in ids]
        removed += len(group["params"]) - len(keep)
        group["params"] = keep
    for p in params:
        optimizer.state.pop(p, None)
    return removed
