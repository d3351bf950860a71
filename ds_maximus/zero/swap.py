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
        from ds_maximus.embedding import ShardedEmbedding
        wrong = [n for n in emb_cfg.modules if not isinstance(named[n], (nn.Embedding, ShardedEmbedding))]
        if wrong:
            raise ConfigError(f"maximus.embedding.modules: {wrong} are not nn.Embedding "
                              f"({[type(named[n]).__name__ for n in wrong]})", "maximus.embedding.modules")
        return list(emb_cfg.modules)
    from ds_maximus.embedding import ShardedEmbedding
    return [n for n, m in named.items()
            if isinstance(m, ShardedEmbedding)
            or (isinstance(m, nn.Embedding) and m.num_embeddings >= emb_cfg.min_rows)]


def swap_embeddings(model: nn.Module, cfg: MaximusConfig) -> SwapPlan:
    """Replace the selected embeddings in place; a tied LM head is re-pointed at the sharded table."""
    from ds_maximus.embedding import ShardedEmbedding

    plan = SwapPlan({}, [], {})
    if not (cfg.enabled and cfg.embedding.enabled):
        return plan
    names = select_embeddings(model, cfg)
    for name in names:
        old = dict(model.named_modules())[name]
        if isinstance(old, ShardedEmbedding):  # already maximized (maximize() before initialize)
            plan.swapped[name] = old
            continue
        heads = [hn for hn, hm in model.named_modules()
                 if isinstance(hm, nn.Linear) and hm.weight is old.weight]
        new = _make_sharded(old, cfg)
        parent, attr = _parent(model, name)
        setattr(parent, attr, new)
        plan.swapped[name] = new
        plan.removed_params.append(old.weight)
        for hn in heads:
            plan.tied_heads[hn] = name
        logger.info("ds_maximus: %s (%d x %d) -> ShardedEmbedding with %d GPU cache rows%s", name,
                    old.num_embeddings, old.embedding_dim, cfg.embedding.gpu_cache_rows,
                    f", tied to {heads}" if heads else "")
    if plan.tied_heads:
        _retie_heads(model, plan, cfg)
    return plan


def _make_sharded(old: nn.Embedding, cfg: MaximusConfig) -> nn.Module:
    """The module for ``distributed.shard_mode``: a partitioned table, or a whole one (replicated / broadcast)."""
    from ds_maximus.config import ShardMode
    from ds_maximus.embedding import ShardedEmbedding
    mode = cfg.distributed.shard_mode
    if mode == ShardMode.PARTITIONED:
        from ds_maximus.distributed.partitioned_embedding import PartitionedEmbedding
        return PartitionedEmbedding.from_embedding(old, cfg)
    if mode == ShardMode.BROADCAST:
        from ds_maximus.distributed.broadcast import broadcast_embedding
        return broadcast_embedding(old, cfg)
    return ShardedEmbedding.from_embedding(old, cfg.embedding)


def _retie_heads(model: nn.Module, plan: SwapPlan, cfg: MaximusConfig) -> None:
    """A head tied to a swapped embedding becomes a ShardedLMHead on the same table."""
    try:
        from ds_maximus.embedding import ShardedLMHead
    except ImportError as e:  # pragma: no cover - the LM head ships with the package
        raise ConfigError("a tied LM head needs ShardedLMHead, which failed to import") from e
    for head_name, emb_name in plan.tied_heads.items():
        parent, attr = _parent(model, head_name)
        old = getattr(parent, attr)
        if old.bias is not None:
            raise ConfigError(f"{head_name} is tied to {emb_name} but has a bias; maximus cannot tie it")
        emb = plan.swapped[emb_name]
        setattr(parent, attr, ShardedLMHead.from_linear(old, cfg.lm_head, tied_to=emb)
                if hasattr(ShardedLMHead, "from_linear") else ShardedLMHead(tied_to=emb, config=cfg.lm_head))
        if hasattr(model, "config") and hasattr(model.config, "tie_word_embeddings"):
            # the HF tying machinery must not try to re-tie a weight that no longer exists
            model.config.tie_word_embeddings = False


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
