"""The slow tiers behind a partition cache: where entries live when they are not in cache slots.

A tier holds ``num_ids`` entries, each a set of named tensors of fixed shape (a vocab row with its
optimizer state, one expert's flat buffer with its master and moments). Vocabulary rows, the LM head and
MoE experts, in inference and training, use the same two implementations of one protocol, :class:`Tier`:

* :class:`TensorTier`: every entry in (pinned) CPU memory, each table mapped in pieces of whole entries
  (:class:`ds_maximus.partition.host_memory.PiecedHostTable`) and planned against free host memory before
  anything is allocated (:meth:`TensorTier.allocate`), or built from given tensors (one piece each).
* :class:`ds_maximus.partition.store_tier.ShardStoreTier`: entries in a
  :class:`ds_maximus.store.ShardStore` on NVMe (one on-disk format for rows and experts), read through the
  async NVMe loader, with a bounded CPU cache of whole shards.

The protocol (everything a cache, a transfer engine or a store needs):

* ``names``, ``num_ids``, ``entry_shape(name)``, ``dtype(name)``, ``entry_bytes``: the table's layout.
* ``read(ids, out)`` / ``write(ids, src)``: copy entries out of / into the tier, batched by id.
* ``host_view(i, name)``: entry ``i`` as a CPU tensor *in* the tier (writes through it persist; copying from it
  is one DMA when the tier is pinned), or ``None`` where the entry is not held in host memory (NVMe).
* ``pieces(name)``: the tier's contiguous (pinned) pieces ``(lo, hi, tensor)`` covering the table, for copy
  kernels that address host memory directly (UVA) and for DMA; empty for NVMe. An entry never straddles two
  pieces.
* ``check_ids(ids)``: an id outside ``[0, num_ids)`` is an :class:`IndexError` naming it and the table size.
* ``blocks()``, ``materialize(name)``, ``load(tensors)``, ``flush()``, ``close()``: whole-table access
  (checkpoints) and durability; ``mark_dirty_range(lo, hi)`` after edits made through a block's views.
* ``whole_tables()``: every table as one host tensor where the tier holds it so (a CPU tier of one piece), else
  ``None``; ``nbytes()``: the bytes of the whole table, every name together.

>>> import torch
>>> tier = TensorTier({"weight": torch.arange(6.).view(3, 2)})
>>> out = {"weight": torch.empty(2, 2)}
>>> tier.read(torch.tensor([2, 0]), out); out["weight"].tolist()
[[4.0, 5.0], [0.0, 1.0]]
>>> tier.host_view(1).tolist(), [(lo, hi) for lo, hi, _ in tier.pieces("weight")]
([2.0, 3.0], [(0, 3)])
"""
from __future__ import annotations

import math
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ds_maximus.partition.host_memory import HOST_RESERVE_BYTES, HostMemoryPlan, HostTier, PiecedHostTable, TierDemand

Block = Tuple[int, int, Dict[str, Tensor]]
Piece = Tuple[int, int, Tensor]


class Tier:
    """The protocol of a backing tier (entries indexed by id in ``[0, num_ids)``); see the module docstring."""

    names: Tuple[str, ...] = ()
    num_ids: int = 0
    pinned: bool = False

    def entry_shape(self, name: str) -> Tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, name: str) -> torch.dtype:
        raise NotImplementedError

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry, every name together."""
        return sum(math.prod(self.entry_shape(n)) * torch.empty((), dtype=self.dtype(n)).element_size()
                   for n in self.names)

    def check_ids(self, ids: Tensor) -> Tensor:
        """``ids`` as a flat CPU LongTensor; an id outside ``[0, num_ids)`` is an IndexError naming it."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_ids):
            bad = int(ids[(ids < 0) | (ids >= self.num_ids)][0])
            raise IndexError(f"id {bad} is out of range for a tier of {self.num_ids} entries "
                             f"(ids are 0..{self.num_ids - 1})")
        return ids

    def read(self, ids: Tensor, out: Dict[str, Tensor]) -> None:
        """Copy entries ``ids`` (CPU LongTensor) into ``out[name][:len(ids)]`` (CPU tensors), for every name."""
        raise NotImplementedError

    def write(self, ids: Tensor, src: Dict[str, Tensor]) -> None:
        """Store ``src[name][i]`` as entry ``ids[i]`` (every name of the tier)."""
        raise NotImplementedError

    def host_view(self, i: int, name: str = "weight") -> Optional[Tensor]:
        """Entry ``i`` of ``name`` as a CPU tensor inside the tier, or ``None`` where it is not in host memory."""
        return None

    def pieces(self, name: str = "weight") -> List[Piece]:
        """``(lo, hi, tensor [hi - lo, *entry_shape])`` pieces of table ``name`` in host memory (none on NVMe)."""
        return []

    def whole_tables(self) -> Optional[Dict[str, Tensor]]:
        """Every table as one ``[num_ids, *entry_shape]`` CPU tensor *in* the tier, or ``None`` where the tier
        does not hold its tables so (NVMe, or host tables mapped in several pieces): what whole-table users
        (UVA row copies, whole-table optimizer steps) ask before taking that path."""
        return None

    def nbytes(self) -> int:
        """Bytes of the whole table, every name together (``num_ids`` entries of :attr:`entry_bytes`)."""
        return self.num_ids * self.entry_bytes

    def blocks(self, block_rows: int = 32768) -> Iterator[Block]:
        """Yield ``(lo, hi, tensors)`` covering every entry; in-place edits of the views persist."""
        raise NotImplementedError

    def mark_dirty_range(self, lo: int, hi: int) -> None:
        """Entries ``[lo, hi)`` were edited through the views :meth:`blocks` yielded: a tier that caches them
        (NVMe) writes them back on :meth:`flush`; a no-op where those views are the tier's own memory."""

    def flush(self) -> None:
        """Make every write durable (NVMe tier); a no-op for memory tiers."""

    def close(self) -> None:
        """Flush and release what the tier holds open."""
        self.flush()

    def materialize(self, name: str) -> Tensor:
        """The whole table of ``name`` as one CPU tensor (a copy)."""
        out = torch.empty((self.num_ids, *self.entry_shape(name)), dtype=self.dtype(name))
        for lo, hi, t in self.blocks():
            out[lo:hi].copy_(t[name])
        return out

    def load(self, tensors: Dict[str, Tensor]) -> None:
        """Overwrite whole tables (``[num_ids, ...]`` each; names not given are kept)."""
        for lo, hi, t in self.blocks():
            for name, src in tensors.items():
                t[name].copy_(src[lo:hi])


class TensorTier(Tier):
    """The pinned-CPU tier: every entry in CPU memory, each table mapped in pieces of whole entries.

    ``TensorTier(tensors, pin_memory)`` keeps the given ``[num_ids, ...]`` tensors (one piece each; pinned when
    ``pin_memory`` and CUDA exist). :meth:`allocate` plans a new table against free host memory and maps it in
    pieces of about ``piece_bytes`` (each allocated, and page-locked with ``cudaHostRegister``, when first
    used), so a 90 GB table is never one registration. ``tensors`` is every table as one tensor, for tables of
    one piece (what whole-table optimizer steps and checkpoints of small tables use).
    """

    def __init__(self, tensors: Dict[str, Tensor], pin_memory: bool = False):
        n = {t.shape[0] for t in tensors.values()}
        if len(n) != 1:
            raise ValueError(f"tier tensors disagree on the number of entries: {sorted(n)}")
        self.num_ids = n.pop()
        self.pinned = bool(pin_memory and torch.cuda.is_available())
        self._shapes = {k: tuple(v.shape[1:]) for k, v in tensors.items()}
        self._tables = {k: PiecedHostTable.wrap(_host(v, self.pinned).view(self.num_ids, -1))
                        for k, v in tensors.items()}
        self.names = tuple(self._tables)
        self._whole: Optional[Dict[str, Tensor]] = None

    @classmethod
    def allocate(cls, num_ids: int, entries: Mapping[str, Tuple[Sequence[int], torch.dtype]], pin: bool = True,
                 piece_bytes: Optional[int] = None, what: str = "", fix: str = "",
                 reclaimable_bytes: int = 0, reserve_bytes: int = HOST_RESERVE_BYTES) -> "TensorTier":
        """A zeroed tier of ``num_ids`` entries, ``entries = {name: (entry shape, dtype)}``, pinned when ``pin``
        and CUDA exist. The whole tier is checked against free host memory first (a :class:`CapacityError`
        naming ``what`` and ``fix`` where it does not fit; ``reclaimable_bytes`` is memory that filling it frees,
        ``reserve_bytes`` what the plan leaves free for the process).

        >>> tier = TensorTier.allocate(5, {"weight": ((4,), torch.float32)}, pin=False, piece_bytes=32)
        >>> [(lo, hi) for lo, hi, _ in tier.pieces("weight")], tier.plan.bytes_per_tier()
        ([(0, 2), (2, 4), (4, 5)], {'cpu': 80})
        """
        self = cls.__new__(cls)
        self.num_ids = int(num_ids)
        self.pinned = bool(pin and torch.cuda.is_available())
        self._shapes = {k: tuple(int(s) for s in shape) for k, (shape, _) in entries.items()}
        self.names = tuple(entries)
        entry_bytes = sum(math.prod(self._shapes[k]) * torch.empty((), dtype=d).element_size()
                          for k, (_, d) in entries.items())
        self.plan = HostMemoryPlan([TierDemand(
            HostTier.CPU, self.num_ids * entry_bytes,
            what or f"a CPU tier of {self.num_ids} entries", fix=fix,
            reclaimable_bytes=int(reclaimable_bytes))], reserve_bytes=int(reserve_bytes)).check()
        self._tables = {k: PiecedHostTable(self.num_ids, math.prod(self._shapes[k]), dtype, pin=self.pinned,
                                           piece_bytes=piece_bytes)
                        for k, (_, dtype) in entries.items()}
        self._whole = None
        return self

    # -- layout ---------------------------------------------------------------------------------------
    def entry_shape(self, name):
        return self._shapes[name]

    def dtype(self, name):
        return self._tables[name].dtype

    @property
    def num_pieces(self) -> int:
        """Pieces per table (every table of a tier has the same entries per piece only when their entries are
        the same size; this is the most of any table)."""
        return max((t.num_pieces for t in self._tables.values()), default=0)

    def whole_tables(self):
        """Every table as one tensor when each is one piece, else ``None`` (see :meth:`Tier.whole_tables`)."""
        if self._whole is not None:
            return self._whole
        whole = {k: t.whole for k, t in self._tables.items()}
        if any(w is None for w in whole.values()):
            return None
        self._whole = {k: w.view(self.num_ids, *self._shapes[k]) for k, w in whole.items()}
        return self._whole

    @property
    def tensors(self) -> Dict[str, Tensor]:
        """Every table as one ``[num_ids, *entry_shape]`` tensor (tables of one piece only: for a tier in several
        pieces this is an AttributeError naming the table; :meth:`whole_tables` asks without raising)."""
        whole = self.whole_tables()
        if whole is None:
            k, t = next((k, t) for k, t in self._tables.items() if t.num_pieces > 1)
            raise AttributeError(f"table {k!r} of this tier is mapped in {t.num_pieces} pieces; use pieces({k!r}) "
                                 "or host_view(i), or allocate it with piece_bytes >= its size")
        return whole

    def host_table(self, name: str = "weight") -> PiecedHostTable:
        """The pieced host table that holds ``name`` (flat entries ``[num_ids, numel]``)."""
        return self._tables[name]

    def release(self, name: str) -> None:
        """Give back the memory of table ``name`` (once no view of it is left); its entries read as zeros
        afterwards, mapped anew when next used (a table whose contents moved elsewhere, e.g. to the device)."""
        self._tables[name].release()
        self._whole = None

    def pieces(self, name="weight"):
        t = self._tables[name]
        out = []
        for p in range(t.num_pieces):
            lo, hi = t.piece_range(p)
            out.append((lo, hi, t.piece(p).view(hi - lo, *self._shapes[name])))
        return out

    def host_view(self, i, name="weight"):
        if not 0 <= int(i) < self.num_ids:
            raise IndexError(f"id {int(i)} is out of range for a tier of {self.num_ids} entries "
                             f"(ids are 0..{self.num_ids - 1})")
        return self._tables[name].row(int(i)).view(self._shapes[name])

    # -- reads and writes -------------------------------------------------------------------------------
    def _groups(self, t: PiecedHostTable, ids: Tensor):
        """``(piece, positions in ids, rows in piece)`` for every piece ``ids`` touch."""
        if t.num_pieces == 1:
            yield t.piece(0), None, ids
            return
        which = torch.div(ids, t.rows_per_piece, rounding_mode="floor")
        for p in torch.unique(which).tolist():
            sel = (which == p).nonzero().squeeze(1)
            yield t.piece(p), sel, ids[sel] - p * t.rows_per_piece

    def read(self, ids, out):
        ids = self.check_ids(ids)
        n = ids.numel()
        for name, t in self._tables.items():
            dst = out[name][:n].view(n, -1)
            for piece, sel, local in self._groups(t, ids):
                if sel is None:
                    torch.index_select(piece, 0, local, out=dst)
                else:
                    dst[sel] = piece[local]

    def write(self, ids, src):
        ids = self.check_ids(ids)
        n = ids.numel()
        for name, t in self._tables.items():
            rows = src[name][:n].reshape(n, -1).to("cpu")
            for piece, sel, local in self._groups(t, ids):
                piece.index_copy_(0, local, rows if sel is None else rows[sel])

    def blocks(self, block_rows=32768):
        """Blocks of at most ``block_rows`` entries, never across a piece."""
        per = max(1, min(int(block_rows), self.num_ids))
        for t in self._tables.values():
            if t.num_pieces > 1:  # a block starts at a multiple of per: it stays inside a piece when per divides it
                per = math.gcd(per, t.rows_per_piece)
        for lo in range(0, self.num_ids, per):
            hi = min(lo + per, self.num_ids)
            yield lo, hi, {k: self._slice(k, lo, hi) for k in self._tables}

    def _slice(self, name: str, lo: int, hi: int) -> Tensor:
        t = self._tables[name]
        p = lo // t.rows_per_piece
        base = p * t.rows_per_piece
        assert hi - base <= t.rows_per_piece, "a block crosses a piece"
        return t.piece(p)[lo - base:hi - base].view(hi - lo, *self._shapes[name])

    def materialize(self, name):
        t = self._tables[name]
        if t.num_pieces == 1:
            return t.piece(0).view(self.num_ids, *self._shapes[name]).clone()
        return super().materialize(name)


def _host(t: Tensor, pin: bool) -> Tensor:
    t = t.detach().to("cpu").contiguous()
    if pin and not t.is_pinned():
        t = t.pin_memory()
    return t
