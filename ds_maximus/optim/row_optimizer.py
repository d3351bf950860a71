"""``RowOptimizer``: the sparse optimizer of a row table (AdamW or Adagrad, ``exact`` or ``lazy``).

It owns what is global to the table: the hyper-parameters, the step counter, the lr and weight
decay of every step (``exact`` mode replays them) and, per row, the last step the row is current
at. The rows themselves live wherever the caller keeps them (cache slots, CPU tier blocks); the
update runs through the fused ``maximus_row_ops`` kernel on those tensors.

>>> import torch
>>> from ds_maximus.config import EmbeddingOptimizerConfig
>>> opt = RowOptimizer(EmbeddingOptimizerConfig(lr=0.1), num_rows=4)
>>> w, m, v = torch.ones(4, 2), torch.zeros(4, 2), torch.zeros(4, 2)
>>> t = opt.begin_step(None, 0.0)
>>> opt.update(w, [m, v], torch.tensor([1]), torch.ones(1, 2), torch.tensor([1]))
>>> [round(x, 3) for x in w[:, 0].tolist()]
[1.0, 0.9, 1.0, 1.0]
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ds_maximus.config import EmbeddingOptimizerConfig, OptimizerType, SparseMode
from ds_maximus.errors import ConfigError
from ds_maximus.ops import index_array
from ds_maximus.optim.sparse_adamw import ADAGRAD, ADAMW


class RowOptimizer:
    """Hyper-parameters, step counter, lr history and per-row last steps of a sparse row optimizer."""

    def __init__(self, config: Optional[EmbeddingOptimizerConfig], num_rows: int,
                 frozen_row: Optional[int] = None):
        cfg = config or EmbeddingOptimizerConfig()
        self.config = cfg
        self.kind = ADAMW if cfg.type == OptimizerType.ADAMW else ADAGRAD
        self.lazy = cfg.mode == SparseMode.LAZY
        self.beta1, self.beta2 = (float(b) for b in cfg.betas)
        self.eps = float(cfg.eps)
        self.num_rows = int(num_rows)
        self.frozen_row = frozen_row
        self.step = 0
        self.lr_hist: List[float] = [0.0]   # [k] = lr of step k (index 0 unused)
        self.wd_hist: List[float] = [0.0]
        self.last_step = torch.zeros(self.num_rows, dtype=torch.long)  # per row id, host
        self._dev_hist: Dict[torch.device, Tuple[Tensor, Tensor, int]] = {}

    @property
    def state_names(self) -> Tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") if self.kind == ADAMW else ("sum",)

    # -- per step --------------------------------------------------------------------------------
    def resolve(self, lr: Optional[float], weight_decay: Optional[float]) -> Tuple[float, float]:
        lr = self.config.lr if lr is None else lr
        if lr is None:
            raise ConfigError("no learning rate for the sparse row optimizer: pass sparse_step(lr=...) or set "
                              "maximus.embedding.optimizer.lr", "maximus.embedding.optimizer.lr")
        wd = self.config.weight_decay if weight_decay is None else weight_decay
        return float(lr), float(wd or 0.0)

    def begin_step(self, lr: Optional[float], weight_decay: Optional[float]) -> int:
        """Record step ``step+1``'s lr and weight decay; returns the new step number."""
        lr, wd = self.resolve(lr, weight_decay)
        self.step += 1
        self.lr_hist.append(lr)
        self.wd_hist.append(wd)
        return self.step

    def history(self, device: torch.device) -> Tuple[Tensor, Tensor]:
        """lr and weight-decay history on ``device`` (float64, index k = step k), grown incrementally.

        On a GPU the new steps go up from a pinned mirror (a pageable copy would wait for the
        stream's queued work); earlier entries of the mirror are never rewritten, so no copy in flight
        reads a changing buffer.
        """
        device = torch.device(device)
        need = len(self.lr_hist)
        dev_t, host, filled = self._dev_hist.get(device, (None, None, 0))
        if dev_t is None or dev_t.shape[1] < need:
            cap = max(1024, 2 * need)
            new = torch.zeros(2, cap, dtype=torch.float64, device=device)
            new_host = torch.zeros(2, cap, dtype=torch.float64, pin_memory=device.type == "cuda")
            if dev_t is not None:
                new[:, :filled].copy_(dev_t[:, :filled])
                new_host[:, :filled].copy_(host[:, :filled])
            dev_t, host = new, new_host
        if filled < need:
            h = host.numpy()
            h[0, filled:need] = self.lr_hist[filled:need]
            h[1, filled:need] = self.wd_hist[filled:need]
            for k in range(2):  # each row's new range is contiguous (a strided copy would stage pageably)
                dev_t[k, filled:need].copy_(host[k, filled:need], non_blocking=True)
        self._dev_hist[device] = (dev_t, host, need)
        return dev_t[0], dev_t[1]

    # -- row updates -----------------------------------------------------------------------------
    def device_index(self, slots: Tensor, ids: Tensor, device: torch.device) -> Tuple[Tensor, Tensor]:
        """``slots`` and the last steps of rows ``ids`` (CPU) on ``device``, in one copy on the current stream,
        for :meth:`update`'s ``index``. A caller that streams rows in on a load stream queues this there, ahead of
        the rows: an update on another stream then has no host-to-device copy of its own, which would wait in the
        copy engine behind the load stream's next rows (on the H200 that serialised the MoE step's two link
        directions)."""
        from ds_maximus.ops import to_device_pair
        return to_device_pair(slots, torch.from_numpy(self.last_step.numpy()[index_array(ids)]), device)

    def update(self, weight: Tensor, states: List[Tensor], slots: Tensor, grads: Tensor, ids: Tensor, *,
               grad_scale: float = 1.0, shadow: Optional[Tensor] = None,
               index: Optional[Tuple[Tensor, Tensor]] = None) -> None:
        """Apply step ``self.step`` with ``grads`` to rows ``slots`` (ids ``ids``, CPU) of the given tensors.

        In ``exact`` mode the rows' skipped steps are replayed first (fused in the same kernel). On CPU
        tensors, ``grad_scale`` and ``shadow`` go to :func:`ops.row_update` (same pass). ``index``: the
        :meth:`device_index` of ``slots`` and ``ids``, made earlier (the same step, these rows not updated since).
        """
        from ds_maximus.ops import row_ops as ops
        if ids.numel() == 0:
            return
        lr_h, wd_h = self.history(weight.device)
        ids_np = index_array(ids)
        last = self.last_step.numpy()
        slots, last_steps = index if index is not None else (slots, torch.from_numpy(last[ids_np]))
        ops.row_update(weight, states, slots, grads, last_steps,
                       step=self.step, lr_hist=lr_h, wd_hist=wd_h, lr=self.lr_hist[self.step],
                       weight_decay=self.wd_hist[self.step], beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                       optimizer=self.kind, lazy=self.lazy, grad_scale=grad_scale, shadow=shadow)
        last[ids_np] = self.step

    def lagging(self, ids: Tensor) -> Tensor:
        """Mask of ``ids`` (CPU) whose rows miss replayed steps (always empty in ``lazy`` mode)."""
        if self.lazy or self.step == 0:
            return torch.zeros(ids.numel(), dtype=torch.bool)
        ids_np = index_array(ids)
        lag = self.last_step.numpy()[ids_np] < self.step
        if self.frozen_row is not None:
            lag &= ids_np != self.frozen_row
        return torch.from_numpy(lag)

    def catch_up(self, weight: Tensor, states: List[Tensor], slots: Tensor, ids: Tensor,
                 lag: Optional[Tensor] = None) -> Tensor:
        """Replay the skipped steps of rows ``ids`` (in ``slots``); returns the mask of rows changed
        (``lag``: :meth:`lagging` of ``ids`` when the caller has it)."""
        from ds_maximus.ops import row_ops as ops
        lag = self.lagging(ids) if lag is None else lag
        lag_np = lag.numpy()
        if lag_np.any():
            pos = np.flatnonzero(lag_np)
            ids_l = index_array(ids)[pos]
            last = self.last_step.numpy()
            lr_h, wd_h = self.history(weight.device)
            ops.row_update(weight, states, torch.from_numpy(index_array(slots)[pos]), None,
                           torch.from_numpy(last[ids_l]),
                           step=self.step, lr_hist=lr_h, wd_hist=wd_h, lr=0.0, weight_decay=0.0,
                           beta1=self.beta1, beta2=self.beta2, eps=self.eps, optimizer=self.kind, lazy=False)
            last[ids_l] = self.step
        return lag

    # -- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "lr_history": torch.tensor(self.lr_hist, dtype=torch.float64),
                "wd_history": torch.tensor(self.wd_hist, dtype=torch.float64),
                "last_step": self.last_step.clone(), "type": self.config.type.value, "mode": self.config.mode.value}

    def load_state_dict(self, d: dict) -> None:
        if d["last_step"].shape != self.last_step.shape:
            raise ConfigError(f"optimizer state is for {d['last_step'].numel()} rows, this table has "
                              f"{self.num_rows}; load a checkpoint of the same vocabulary size")
        self.step = int(d["step"])
        self.lr_hist = [float(x) for x in d["lr_history"].tolist()]
        self.wd_hist = [float(x) for x in d["wd_history"].tolist()]
        self.last_step = d["last_step"].clone().to(torch.long)
        self._dev_hist.clear()
