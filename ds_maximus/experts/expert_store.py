"""The expert stores: MoE experts in the partition core's slow tiers (pinned CPU memory, or NVMe).

An expert is addressed by a *uid* (``layer * num_experts + expert``) and stored as one flat buffer
of ``layout.numel`` elements (see :mod:`ds_maximus.experts.layout`), so bringing it to the GPU is one
``copy_(..., non_blocking=True)``. The stores are thin: the bytes live in a
:class:`ds_maximus.partition.tier.Tier` (``store.backing``), the same tiers that hold vocabulary rows:
:class:`CpuExpertStore` in a :class:`~ds_maximus.partition.tier.TensorTier` (pieced, planned against free host
memory), :class:`FileExpertStore` in a :class:`~ds_maximus.partition.store_tier.ShardStoreTier` (one shard
per expert, the shard store's on-disk format).

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

from ds_maximus.errors import ConfigError
from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.partition.store_tier import ShardStoreTier
from ds_maximus.partition.tier import TensorTier, Tier
from ds_maximus.store.format import ALIGN_BYTES

FILE_ALIGN_BYTES = ALIGN_BYTES  # O_DIRECT alignment of every expert's data on disk (its shard file's header is padded)


class ExpertStore:
    """Base of the stores. ``host_view(uid)`` is a CPU flat tensor to copy from, or ``None`` when the
    expert must first be read (``read_into``). ``backing`` is the partition tier that holds the experts."""

    layout: ExpertLayout
    num_uids: int
    tier: str = "?"  # the tier's label in stats ("cpu", "nvme")
    backing: Optional[Tier] = None

    def check_uid(self, uid: int) -> int:
        """``uid`` as an int; one outside ``[0, num_uids)`` is an IndexError, never a read or write past the table."""
        if not 0 <= int(uid) < self.num_uids:
            raise IndexError(f"expert uid {int(uid)} is out of range; the {self.tier} expert store holds "
                             f"{self.num_uids} (uids 0..{self.num_uids - 1})")
        return int(uid)

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

    The experts are a :class:`~ds_maximus.partition.tier.TensorTier` of one table: planned before anything is
    allocated (a table larger than the host's free memory is a :class:`CapacityError` with the numbers and the
    fix) and mapped in pieces of whole experts (about ``piece_bytes`` each, pinned one by one as they are first
    written). ``reclaimable_bytes``: CPU memory that filling the store frees (the model's own CPU expert
    weights, dropped layer by layer as ``offload_experts`` copies them in).
    """

    tier = "cpu"

    def __init__(self, layout: ExpertLayout, num_uids: int, pin_memory: bool = True,
                 reclaimable_bytes: int = 0, piece_bytes: Optional[int] = None):
        self.layout = layout
        self.num_uids = int(num_uids)
        self.pinned = bool(pin_memory and _can_pin())
        self.backing = TensorTier.allocate(
            self.num_uids, {"weight": ((layout.numel,), layout.dtype)}, pin=self.pinned, piece_bytes=piece_bytes,
            what=f"{self.num_uids} experts of {layout.nbytes / 2**20:.1f} MiB ({layout.dtype})",
            fix="put the experts on NVMe (moe.offload.device = 'nvme' with an nvme_path), offload a model with "
                "fewer experts or layers, or run where more host memory is free",
            reclaimable_bytes=int(reclaimable_bytes))
        self.plan = self.backing.plan

    @property
    def table(self):
        """The pieced host table of the experts (:class:`~ds_maximus.partition.host_memory.PiecedHostTable`)."""
        return self.backing.host_table("weight")

    def host_view(self, uid: int) -> torch.Tensor:
        return self.backing.host_view(self.check_uid(uid))

    def write(self, uid: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.layout.pack_(self.host_view(uid), tensors)


class FileExpertStore(ExpertStore):
    """Experts on NVMe: a shard store folder at ``path`` holding one shard file per expert (the format of every
    NVMe table; data 4 KiB aligned, O_DIRECT-ready), through a :class:`ShardStoreTier` with no CPU shard cache.

    Reads go through the async NVMe loader (``loader``, else the process's own when its op is available here,
    else plain reads) straight into the destination. ``host_view`` is ``None``: the cache reads each expert
    into a pinned staging buffer (GPU) or straight into its slot (CPU compute). Experts are written in uid
    order as ``offload_experts`` copies them in, so the folder only ever holds what was written (a uid not
    yet written reads as zeros). The store is this process's own (made new at ``path``): reads check each
    file's size and header, not its checksum.
    """

    tier = "nvme"

    def __init__(self, layout: ExpertLayout, num_uids: int, path: str, loader=None):
        from ds_maximus.store import ShardStore
        self.layout = layout
        self.num_uids = int(num_uids)
        self.record_bytes = self.record_bytes_for(layout)
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ConfigError(f"moe.offload.nvme_path folder {folder} does not exist; create it or point "
                              "nvme_path at a folder on a local NVMe disk", "maximus.moe.offload.nvme_path")
        if os.path.islink(path) or (os.path.exists(path) and not os.path.isdir(path)):
            raise ConfigError(f"{path} is a symlink or not a folder; the expert tier writes its own shard store "
                              "there and follows no links: remove it or point moe.offload.nvme_path at another "
                              "folder", "maximus.moe.offload.nvme_path")
        self.path = path
        os.makedirs(path, exist_ok=True)
        # O_NOFOLLOW: a link swapped in after the check is refused, never written through
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        os.close(fd)
        self.loader = loader
        store = ShardStore.create(path, 0, layout.numel, layout.dtype, rows_per_shard=1, loader=loader,
                                  overwrite=True)
        store.verify_checksums = False
        self.backing = ShardStoreTier(store, cpu_cache_shards=0)
        self._scratch = torch.empty(1, layout.numel, dtype=layout.dtype)

    @staticmethod
    def record_bytes_for(layout: ExpertLayout) -> int:
        """Bytes one expert takes on disk: its shard file (the header padded to 4 KiB, then the data)."""
        return FILE_ALIGN_BYTES + layout.nbytes

    @staticmethod
    def existing_bytes(path: str) -> int:
        """Bytes of the shard files of an expert store at ``path`` now (what replacing it frees; other files
        there are kept, so they are not counted)."""
        from ds_maximus.store.index import SHARD_FILE_RE
        if not os.path.isdir(path) or os.path.islink(path):
            return 0
        return sum(e.stat().st_size for e in os.scandir(path)
                   if e.is_file(follow_symlinks=False) and SHARD_FILE_RE.fullmatch(e.name))

    def host_view(self, uid: int) -> None:
        return None

    @property
    def num_written(self) -> int:
        """Experts on disk: uids ``0 .. num_written - 1`` (the rest read as zeros until written)."""
        return self.backing.num_ids

    def write(self, uid: int, tensors: Mapping[str, torch.Tensor]) -> None:
        uid = self.check_uid(uid)
        self.layout.pack_(self._scratch[0], tensors)
        if uid < self.backing.num_ids:
            self.backing.write(torch.tensor([uid]), {"weight": self._scratch})
            return
        while self.backing.num_ids < uid:  # a uid written out of order: the ones before it start as zeros
            self.backing.append({"weight": torch.zeros(1, self.layout.numel, dtype=self.layout.dtype)})
        self.backing.append({"weight": self._scratch})

    def read_into(self, uid: int, dst: torch.Tensor) -> None:
        assert dst.numel() == self.layout.numel and dst.is_contiguous() and dst.device.type == "cpu"
        uid = self.check_uid(uid)
        if uid >= self.backing.num_ids:
            dst.zero_()
            return
        self.backing.read(torch.tensor([uid]), {"weight": dst.view(1, -1)})

    def close(self) -> None:
        self.backing.close()
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
