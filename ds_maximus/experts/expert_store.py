"""The slow tiers of the expert cache: pinned CPU memory, or a file on NVMe.

An expert is addressed by a *uid* (``layer * num_experts + expert``) and stored as one flat buffer
of ``layout.numel`` elements (see :mod:`ds_maximus.experts.layout`), so bringing it to the GPU is one
``copy_(..., non_blocking=True)``.

    >>> import torch
    >>> from ds_maximus.experts.layout import ExpertLayout
    >>> lay = ExpertLayout.from_stacked({"w": torch.zeros(2, 4, 4)}, num_experts=2)
    >>> store = CpuExpertStore(lay, num_uids=2, pin_memory=False)
    >>> store.write(1, {"w": torch.ones(4, 4)})
    >>> float(lay.view(store.host_view(1), "w").sum())
    16.0
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

import torch

from ds_maximus.errors import ConfigError, NVMeIOError
from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.partition.host_memory import HostMemoryPlan, HostTier, PiecedHostTable, TierDemand

FILE_ALIGN_BYTES = 4096  # O_DIRECT alignment of every expert record in the file tier


class ExpertStore:
    """Base of the tiers. ``host_view(uid)`` is a CPU flat tensor to copy from, or ``None`` when the
    expert must first be read (``read_into``)."""

    layout: ExpertLayout
    num_uids: int
    tier: str = "?"

    def host_view(self, uid: int) -> Optional[torch.Tensor]:
        raise NotImplementedError

    def read_into(self, uid: int, dst: torch.Tensor) -> None:
        src = self.host_view(uid)
        assert src is not None
        dst.copy_(src)

    def write(self, uid: int, tensors: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def read(self, uid: int) -> torch.Tensor:
        """One expert's flat buffer, as a new CPU tensor (for tests and checkpoints)."""
        out = torch.empty(self.layout.numel, dtype=self.layout.dtype)
        self.read_into(uid, out)
        return out

    def close(self) -> None:
        pass


def _can_pin() -> bool:
    return torch.cuda.is_available()


class CpuExpertStore(ExpertStore):
    """Every expert in page-locked CPU memory, one flat buffer each (``host_view(uid)``).

    The table is planned before anything is allocated (:class:`HostMemoryPlan`: a table larger than the
    host's free memory is a :class:`CapacityError` with the numbers and the fix) and mapped in pieces of
    whole experts (:class:`PiecedHostTable`, about ``piece_bytes`` each, pinned one by one as they are first
    written). ``reclaimable_bytes``: CPU memory that filling the store frees (the model's own CPU expert
    weights, dropped layer by layer as ``offload_experts`` copies them in).
    """

    tier = "cpu"

    def __init__(self, layout: ExpertLayout, num_uids: int, pin_memory: bool = True,
                 reclaimable_bytes: int = 0, piece_bytes: Optional[int] = None):
        self.layout = layout
        self.num_uids = int(num_uids)
        self.pinned = bool(pin_memory and _can_pin())
        self.plan = HostMemoryPlan([TierDemand(
            HostTier.CPU, self.num_uids * layout.nbytes,
            f"{self.num_uids} experts of {layout.nbytes / 2**20:.1f} MiB ({layout.dtype})",
            fix="put the experts on NVMe (moe.offload.device = 'nvme' with an nvme_path), offload a model with "
                "fewer experts or layers, or run where more host memory is free",
            reclaimable_bytes=int(reclaimable_bytes))]).check()
        self.table = PiecedHostTable(self.num_uids, layout.numel, layout.dtype, pin=self.pinned,
                                     piece_bytes=piece_bytes)

    def host_view(self, uid: int) -> torch.Tensor:
        return self.table.row(uid)

    def write(self, uid: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.layout.pack_(self.table.row(uid), tensors)


class FileExpertStore(ExpertStore):
    """Experts in one raw file, record ``uid`` at ``uid * record_bytes`` (4 KiB aligned, O_DIRECT-ready).

    Reads go through :class:`ds_maximus.ops.nvme_loader.NVMeLoader` when that op is available, else
    plain ``readinto``. ``host_view`` is ``None``: the cache reads each expert into a pinned staging
    buffer (GPU) or straight into its slot (CPU compute).
    """

    tier = "nvme"

    def __init__(self, layout: ExpertLayout, num_uids: int, path: str, loader=None):
        self.layout = layout
        self.num_uids = int(num_uids)
        self.record_bytes = (layout.nbytes + FILE_ALIGN_BYTES - 1) // FILE_ALIGN_BYTES * FILE_ALIGN_BYTES
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ConfigError(f"moe.offload.nvme_path folder {folder} does not exist; create it or point "
                              "nvme_path at a folder on a local NVMe disk", "maximus.moe.offload.nvme_path")
        if os.path.islink(path) or (os.path.exists(path) and not os.path.isfile(path)):
            raise ConfigError(f"{path} is a symlink or not a regular file; the expert tier writes its own file there "
                              "and follows no links: remove it or point moe.offload.nvme_path at another folder",
                              "maximus.moe.offload.nvme_path")
        self.path = path
        # O_NOFOLLOW: a link created in between is refused, never written through
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            os.ftruncate(fd, self.record_bytes * self.num_uids)
        finally:
            os.close(fd)
        self.loader = loader
        self._scratch = torch.empty(layout.numel, dtype=layout.dtype)

    def host_view(self, uid: int) -> None:
        return None

    def _offset(self, uid: int) -> int:
        """Byte offset of ``uid``'s record; a uid outside ``[0, num_uids)`` is an IndexError, never a read or
        write past the table."""
        if not 0 <= int(uid) < self.num_uids:
            raise IndexError(f"expert uid {uid} is out of range; the expert file {self.path} holds {self.num_uids}")
        return int(uid) * self.record_bytes

    def write(self, uid: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self._offset(uid)
        self.layout.pack_(self._scratch, tensors)
        data = self._scratch.view(torch.uint8).numpy().tobytes()
        with open(self.path, "r+b") as f:
            f.seek(uid * self.record_bytes)
            f.write(data)

    def read_into(self, uid: int, dst: torch.Tensor) -> None:
        assert dst.numel() == self.layout.numel and dst.is_contiguous() and dst.device.type == "cpu"
        offset = self._offset(uid)
        if self.loader is not None:
            self.loader.read_into(self.path, offset, dst).wait()
            return
        view = dst.view(torch.uint8).numpy()
        with open(self.path, "rb", buffering=0) as f:
            f.seek(offset)
            n = f.readinto(memoryview(view))
        if n != self.layout.nbytes:
            raise NVMeIOError(f"short read of expert {uid} from {self.path} at offset {offset}: {n} of "
                              f"{self.layout.nbytes} bytes; the file is truncated, re-run offload_experts",
                              self.path, offset)

    def close(self) -> None:
        if self.loader is not None and hasattr(self.loader, "close"):
            self.loader.close()


def make_loader(io_cfg):
    """The async NVMe loader when its op is available here, else ``None`` (plain reads)."""
    try:
        from ds_maximus.ops.nvme_loader import NVMeLoader, nvme_loader_available
    except ImportError:
        return None
    try:
        if not nvme_loader_available():
            return None
        return NVMeLoader.from_config(io_cfg)
    except Exception:
        return None
