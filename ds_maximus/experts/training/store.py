"""Where trained experts live: fp32 master + optimizer state in a tier, and the compute copy the cache loads.

Each expert is one *row* of ``layout.numel`` elements, addressed by its uid (``layer * num_experts +
expert``) like in the inference store. The tier (:class:`ds_maximus.partition.TensorTier` in pinned CPU
memory, or :class:`ds_maximus.partition.store_tier.ShardStoreTier` on NVMe, one expert per shard) holds
``weight`` (the fp32 master) and the optimizer's state tensors. When the compute dtype is fp32 and
the tier is in memory, the expert cache loads straight from the master; in bf16/fp16 a *shadow* copy
in the compute dtype (pinned) is kept beside it and refreshed after every update, so a load moves 2
bytes per parameter, not 4 (ZeRO's bf16 optimizer keeps the same two copies). From NVMe, a load reads
the master through the tier's CPU shard cache and casts it (no full copy in CPU memory).

    >>> import torch
    >>> from ds_maximus.experts.layout import ExpertLayout
    >>> lay = ExpertLayout.from_stacked({"w": torch.zeros(2, 2, 2)}, num_experts=2)
    >>> st = ExpertTrainStore(lay, num_uids=2, state_names=("exp_avg", "exp_avg_sq"), compute_dtype=torch.bfloat16)
    >>> st.write_master(1, {"w": torch.ones(2, 2)})
    >>> st.host_view(1).dtype, float(st.host_view(1)[:4].sum())
    (torch.bfloat16, 4.0)
"""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Sequence

import torch
from torch import Tensor

from ds_maximus.errors import ConfigError
from ds_maximus.experts.expert_store import ExpertStore
from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.partition import TensorTier
from ds_maximus.partition.host_memory import host_tensor


class ExpertTrainStore(ExpertStore):
    """fp32 masters + optimizer state of every expert (the tier) and their compute-dtype copies.

    It is the :class:`ExpertStore` the training cache loads from: ``host_view(uid)`` is the compute
    copy (the master itself when that is fp32 in memory), ``read_into`` reads it from NVMe otherwise.
    """

    def __init__(self, layout: ExpertLayout, num_uids: int, state_names: Sequence[str],
                 compute_dtype: torch.dtype = torch.float32, nvme_path: Optional[str] = None,
                 cpu_cache_shards: int = 8, pin_memory: bool = True):
        self.num_uids = int(num_uids)
        self.state_names = tuple(state_names)
        self.names = ("weight", *self.state_names)
        self.pin = bool(pin_memory and torch.cuda.is_available())
        self.master_layout = ExpertLayout(layout.names, layout.shapes, layout.offsets, layout.numel, torch.float32)
        n = layout.numel
        if nvme_path is None:  # each table one exact-size piece (optimizer steps index whole tables), pinned once
            self.backing = TensorTier.allocate(
                self.num_uids, {name: ((n,), torch.float32) for name in self.names}, pin=self.pin,
                piece_bytes=max(1, self.num_uids * n * 4), reserve_bytes=0,
                what=f"the fp32 masters and {list(self.state_names) or 'no'} state of {self.num_uids} experts",
                fix="use the NVMe tier (offload.device = 'nvme') or fewer experts")
        else:
            from ds_maximus.partition.store_tier import ShardStoreTier
            os.makedirs(nvme_path, exist_ok=True)
            self.backing = ShardStoreTier.for_table(nvme_path, self.num_uids, n, self.state_names, rows_per_shard=1,
                                                 cpu_cache_shards=cpu_cache_shards,
                                                 init=lambda lo, hi: torch.zeros(hi - lo, n),
                                                 pin_memory=pin_memory, overwrite=True)
        self.tier = "cpu" if nvme_path is None else "nvme"  # the label ExpertStore users print
        self.shadow: Optional[Tensor] = None
        # moe.gpu_state_experts: uid -> row of ``device_tables`` (masters and state kept on the compute device)
        self.resident: Dict[int, int] = {}
        self.device_tables: Dict[str, Tensor] = {}
        self._newer: set = set()  # resident uids stepped on the device since the tier's rows were written
        self.set_compute_dtype(compute_dtype)

    # -- the compute copy (what ExpertCache loads) -------------------------------------------------
    @property
    def in_memory(self) -> bool:
        return isinstance(self.backing, TensorTier)

    @property
    def tables(self) -> Dict[str, Tensor]:
        """The in-memory tier's tables ``{name: [num_uids, numel] fp32}``, which an optimizer step updates in
        place (the rows of ``moe.gpu_state_experts`` experts are current after :meth:`pull`)."""
        if not self.in_memory:
            raise ConfigError("the experts' tier is on NVMe: read its rows with read_rows, write them with write_rows")
        return self.backing.tensors

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        """Compute copies in ``dtype`` (a shadow is built from the masters when it is not fp32 in memory)."""
        self.pull()
        self.layout = ExpertLayout(self.master_layout.names, self.master_layout.shapes, self.master_layout.offsets,
                                   self.master_layout.numel, dtype)
        if dtype == torch.float32 or not self.in_memory:  # NVMe: loads read the tier (its CPU shard cache)
            self.shadow = None
            return
        self.shadow = None  # the old one (if any) is freed before the new one is allocated
        self.shadow = host_tensor((self.num_uids, self.layout.numel), dtype, pin=self.pin,
                                  init=lambda t: t.copy_(self.backing.tensors["weight"]))

    def host_view(self, uid: int) -> Optional[Tensor]:
        if self.shadow is not None:
            return self.shadow[uid]
        return self.backing.tensors["weight"][uid] if self.in_memory else None

    def refresh(self, uid: int, master: Tensor, offset: int = 0) -> None:
        """Elements ``offset:`` of ``uid``'s master changed to ``master`` (flat, any device): update the copy."""
        if self.shadow is not None:
            self.shadow[uid][offset:offset + master.numel()].copy_(master)

    # -- masters ----------------------------------------------------------------------------------
    def master_row(self, uid: int) -> Tensor:
        """The fp32 master of ``uid`` (a view in memory, a copy from NVMe)."""
        self.pull([uid])
        if self.in_memory:
            return self.backing.tensors["weight"][uid]
        out = {name: torch.empty(1, self.layout.numel) for name in self.names}
        self.backing.read(torch.tensor([uid]), out)
        return out["weight"][0]

    def write_master(self, uid: int, tensors: Mapping[str, Tensor]) -> None:
        """Set expert ``uid``'s master from its named tensors (optimizer state untouched)."""
        flat = torch.zeros(self.layout.numel)
        self.master_layout.pack_(flat, {k: v.detach().float().cpu() for k, v in tensors.items()})
        self.write_rows(torch.tensor([uid]), {"weight": flat[None]}, names=("weight",))
        self.refresh(uid, flat)

    def write_layer(self, first_uid: int, tensors: Mapping[str, Tensor]) -> None:
        """Set the masters of experts ``first_uid, first_uid + 1, ...`` from stacked tensors ``{name: [E, ...]}``
        (any dtype/device): in memory, one strided copy per tensor into the table, one into the shadow."""
        lay = self.master_layout
        missing = [name for name in lay.names if name not in tensors]
        if missing:
            raise ConfigError(f"expert tensors {missing} are missing (got {sorted(tensors)}); pass every tensor of "
                              f"the layout {list(lay.names)}")
        e = int(tensors[lay.names[0]].shape[0])
        for name in lay.names:
            if tuple(tensors[name].shape) != (e, *lay.shapes[name]):
                raise ConfigError(f"expert tensor '{name}' has shape {tuple(tensors[name].shape)}; this store expects "
                                  f"[{e}, {', '.join(map(str, lay.shapes[name]))}]")
        if not 0 <= first_uid <= self.num_uids - e:
            raise IndexError(f"experts {first_uid}..{first_uid + e - 1} are outside the store's {self.num_uids} uids")
        if not self.in_memory:
            for i in range(e):
                self.write_master(first_uid + i, {name: tensors[name][i] for name in lay.names})
            return
        self.pull(range(first_uid, first_uid + e))
        rows = self.backing.tensors["weight"][first_uid:first_uid + e]
        for name in lay.names:
            lay.stacked_view(rows, name).copy_(tensors[name].detach())
        if self.shadow is not None:
            self.shadow[first_uid:first_uid + e].copy_(rows)
        self.push([u for u in range(first_uid, first_uid + e) if u in self.resident])

    def read_rows(self, uids: Tensor, pin: bool = False) -> Dict[str, Tensor]:
        """Copies of the masters and states of ``uids`` as ``{name: [n, numel] fp32}``."""
        self.pull(uids.tolist())
        out = {name: torch.empty(uids.numel(), self.layout.numel, pin_memory=pin and self.pin) for name in self.names}
        self.backing.read(uids, out)
        return out

    def write_rows(self, uids: Tensor, rows: Mapping[str, Tensor], names: Optional[Sequence[str]] = None) -> None:
        names = tuple(names or self.names)
        if self.in_memory:
            self.pull(uids.tolist())
            for name in names:
                self.backing.tensors[name].index_copy_(0, uids, rows[name][:uids.numel()].to("cpu"))
            self.push([u for u in uids.tolist() if u in self.resident])
            return
        full = rows
        if set(names) != set(self.names):  # the NVMe tier writes whole entries
            full = self.read_rows(uids)
            for name in names:
                full[name].copy_(rows[name][:uids.numel()])
        self.backing.write(uids, full)

    def read_into(self, uid: int, dst: Tensor) -> None:
        if self.shadow is not None:
            dst.copy_(self.shadow[uid])
        else:
            dst.copy_(self.master_row(uid))

    def flush(self) -> None:
        self.backing.flush()

    def state(self) -> Dict[str, Tensor]:
        """Every table as one CPU tensor each (for checkpoints)."""
        self.pull()
        return {name: self.backing.materialize(name) for name in self.names}

    def load_state(self, tensors: Mapping[str, Tensor]) -> None:
        self._newer.clear()  # every row is overwritten
        self.backing.load({name: tensors[name].float() for name in self.names})
        if self.shadow is not None:
            self.shadow.copy_(self.backing.tensors["weight"])
        self.push()

    # -- masters and state kept on the compute device (moe.gpu_state_experts) ---------------------------------
    def make_resident(self, uids: Sequence[int], device: torch.device) -> None:
        """Keep the masters and optimizer state of ``uids`` on ``device`` too (from the tier's current rows)."""
        if not self.in_memory:  # (the trainer says so before it allocates the tier)
            raise ConfigError("moe.gpu_state_experts needs the experts' tier in CPU memory")
        self.pull()
        self.resident = {int(u): i for i, u in enumerate(uids)}
        self.device_tables = {n: torch.empty(len(self.resident), self.layout.numel, device=device)
                              for n in self.names} if self.resident else {}
        self.push()

    def partition(self, uids: Sequence[int]):
        """``(resident, rest)``: the experts of ``uids`` whose state lives on the device, and the others."""
        return [u for u in uids if u in self.resident], [u for u in uids if u not in self.resident]

    def mark_device_newer(self, uids: Sequence[int]) -> None:
        """A step updated these resident experts on the device: the tier's rows are stale until :meth:`pull`."""
        self._newer.update(uids)

    def pull(self, uids: Optional[Sequence[int]] = None) -> None:
        """Bring the tier's rows of resident ``uids`` (all by default) up to date from the device, where a step
        changed them (before the tier is read)."""
        todo = sorted(self._newer if uids is None else self._newer.intersection(uids))
        if not todo:
            return
        dev = next(iter(self.device_tables.values())).device
        if dev.type == "cuda":  # a step may still run on another stream
            torch.cuda.synchronize(dev)
        for n, rows in self.device_tables.items():
            for u in todo:
                self.backing.tensors[n][u].copy_(rows[self.resident[u]])
        self._newer.difference_update(todo)

    def push(self, uids: Optional[Sequence[int]] = None) -> None:
        """Copy the tier's rows of resident ``uids`` (all of them by default) to the device (after a write)."""
        for u in (self.resident if uids is None else uids):
            i = self.resident[u]
            for n, rows in self.device_tables.items():
                rows[i].copy_(self.backing.tensors[n][u])
