"""Whole-table views and checkpoints of a ``ShardedEmbedding`` (a mixin: the table lives in the cache and
its tier, so every one of these first brings the rows to the current step and writes the cache back).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def whole_table(state_dict: dict, key: str, shape, error_msgs: list) -> Optional[Tensor]:
    """The whole table at ``key`` of a state dict when its shape is ``shape``; else ``None`` with the size mismatch
    in ``error_msgs`` (as ``nn.Module.load_state_dict`` reports one)."""
    w = state_dict[key]
    if tuple(w.shape) != tuple(shape):
        error_msgs.append(f"size mismatch for {key}: checkpoint {tuple(w.shape)}, module {tuple(shape)}")
        return None
    return w


class ShardedStateMixin:
    """``full_weight``, ``flush``, ``state_dict`` support and ``maximus_state_dict`` round trips."""

    def _catch_up_all(self) -> None:
        """Exact mode: bring every row to the current step (cache rows first, then the tier's)."""
        if self.optimizer.lazy or self.optimizer.step == 0:
            return
        resident = self.cache.map.resident_ids()
        if resident.numel():
            self._resident_catch_up(resident)
        self.cache.flush()
        names = self.optimizer.state_names
        for lo, hi, t in self.tier.blocks():
            ids = torch.arange(lo, hi)
            changed = self.optimizer.catch_up(t["weight"], [t[n] for n in names], ids - lo, ids)
            if bool(changed.any()):
                self.tier.mark_dirty_range(lo, hi)

    def flush(self) -> None:
        """Write every dirty cached row back to the tier (and the tier to disk)."""
        self.cache.flush()

    def full_weight(self) -> Tensor:
        """The whole table on CPU in fp32, exact-mode catch-up applied."""
        self._catch_up_all()
        self.cache.flush()
        return self.tier.materialize("weight")

    def maximus_state_dict(self) -> dict:
        """Table + optimizer state + step counters + lr history (exact catch-up applied, cache flushed)."""
        self._catch_up_all()
        self.cache.flush()
        names = ("weight", *self.optimizer.state_names)
        return {"format_version": 1, "num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim,
                "padding_idx": self.padding_idx, "tensors": {n: self.tier.materialize(n) for n in names},
                "optimizer": self.optimizer.state_dict()}

    def load_maximus_state_dict(self, d: dict) -> None:
        from ds_maximus.errors import ConfigError
        if (d["num_embeddings"], d["embedding_dim"]) != (self.num_embeddings, self.embedding_dim):
            raise ConfigError(f"checkpoint table is {d['num_embeddings']}x{d['embedding_dim']}, this module is "
                              f"{self.num_embeddings}x{self.embedding_dim}; load it into a module of that shape")
        names = ("weight", *self.optimizer.state_names)
        missing = [n for n in names if n not in d["tensors"]]
        if missing:
            raise ConfigError(f"checkpoint lacks optimizer tensors {missing} (it holds {sorted(d['tensors'])}); "
                              "was it saved with another optimizer type?")
        self._rows_changed()
        self.cache.clear()
        self._step_pins.clear()
        self._prefetched.clear()
        self.grad.clear()
        self.tier.load({n: d["tensors"][n] for n in names})
        self.optimizer.load_state_dict(d["optimizer"])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.full_weight()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key in state_dict:
            w = whole_table(state_dict, key, (self.num_embeddings, self.embedding_dim), error_msgs)
            if w is not None:
                self._catch_up_all()
                self._rows_changed()
                self.cache.clear()
                self.tier.load({"weight": w.detach().to("cpu", torch.float32)})
                self.optimizer.last_step.fill_(self.optimizer.step)
        elif strict:
            missing_keys.append(key)
        local = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(local, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
