"""Host memory for the slow tiers: plan what each tier needs, check it fits, then map it exactly and in pieces.

Every tier that lives off the GPU (pinned CPU memory, ``/dev/shm``, a file on NVMe) states its demand as a
:class:`TierDemand` (bytes, what for, how to fix a shortfall) *before* it allocates anything; a
:class:`HostMemoryPlan` adds the demands per tier and checks them against :class:`HostResources`: the
kernel's ``MemAvailable`` (capped by a cgroup v2 memory limit), the free space of ``/dev/shm`` and of the
NVMe folder. A plan that does not fit raises :class:`ds_maximus.errors.CapacityError` with the numbers and
the fix, where the alternative is an out-of-memory kill, a raw CUDA error or a disk-full error minutes in.

The memory itself comes from :func:`host_tensor` (one exact-size anonymous mapping, page-locked with
``cudaHostRegister`` after it is written) and :class:`PiecedHostTable` (a table of rows mapped in pieces of
about :data:`PIECE_BYTES`, each allocated when first written, so a 90 GB table never needs one 90 GB
registration and memory it replaces can be freed while it fills). A row never straddles two pieces: each
row (an expert) stays one flat buffer, so moving it is one copy.

    >>> import torch
    >>> plan = HostMemoryPlan([TierDemand(HostTier.CPU, 3 << 30, "an expert table", fix="use NVMe")])
    >>> plan.check(HostResources(mem_available_bytes=16 << 30)).bytes_per_tier()
    {'cpu': 3221225472}
    >>> table = PiecedHostTable(5, 4, torch.float32, piece_bytes=32)   # 2 rows of 16 bytes a piece
    >>> _ = table.row(4).copy_(torch.arange(4.)); table.num_pieces, float(table.row(4).sum())
    (3, 6.0)
"""
from __future__ import annotations

import dataclasses
import enum
import mmap
import os
import shutil
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ds_maximus.errors import CapacityError

GiB = 1 << 30
PIECE_BYTES = 1 << 30  # bytes of one mapped (and page-locked) piece of a table: one registration each
HOST_RESERVE_BYTES = 1 << 30  # host memory a plan leaves free for the process itself (CUDA context, Python)
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context (as torch registers)
MEMINFO = "/proc/meminfo"
SHM_PATH = "/dev/shm"
CGROUP_ROOT = "/sys/fs/cgroup"


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


# -- what the host has ---------------------------------------------------------------------------------
def mem_available_bytes(meminfo: str = MEMINFO) -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (memory a new allocation can have without swapping),
    lowered to what a cgroup v2 memory limit leaves; ``None`` where neither can be read (not Linux)."""
    avail = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    limit = _cgroup_available_bytes()
    if limit is not None:
        avail = limit if avail is None else min(avail, limit)
    return avail


def _cgroup_available_bytes(root: str = CGROUP_ROOT) -> Optional[int]:
    """``memory.max - memory.current`` of this process's cgroup v2, counting its inactive file cache as free."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if rel is None:
            return None
        folder = os.path.join(root, rel.lstrip("/"))
        with open(os.path.join(folder, "memory.max")) as f:
            raw = f.read().strip()
        if raw == "max":
            return None
        with open(os.path.join(folder, "memory.current")) as f:
            current = int(f.read())
        inactive = 0
        with open(os.path.join(folder, "memory.stat")) as f:
            for line in f:
                if line.startswith("inactive_file "):
                    inactive = int(line.split()[1])
        return max(0, int(raw) - current + inactive)
    except (OSError, ValueError, StopIteration):
        return None


def free_disk_bytes(path: str) -> int:
    """Free bytes of the filesystem that holds ``path`` (its nearest existing parent when it is not made yet)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return shutil.disk_usage(p).free


@dataclasses.dataclass(frozen=True)
class HostResources:
    """What the host can give: free memory, free ``/dev/shm``, free space per NVMe folder (bytes each;
    ``None`` where unknown, which no demand is refused for)."""

    mem_available_bytes: Optional[int] = None
    shm_free_bytes: Optional[int] = None
    disk_free_bytes: Dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def probe(cls, paths: Sequence[str] = ()) -> "HostResources":
        """The host's figures now; ``paths`` are the NVMe folders whose free space is read."""
        try:
            shm = shutil.disk_usage(SHM_PATH).free if os.path.isdir(SHM_PATH) else None
        except OSError:
            shm = None
        return cls(mem_available_bytes(), shm, {os.path.abspath(p): free_disk_bytes(p) for p in paths})


# -- what a tier needs -----------------------------------------------------------------------------------
class HostTier(str, enum.Enum):
    """Where a slow tier keeps its bytes."""

    CPU = "cpu"    # (pinned) anonymous CPU memory
    SHM = "shm"    # shared memory files under /dev/shm
    NVME = "nvme"  # a file in an NVMe folder


@dataclasses.dataclass(frozen=True)
class TierDemand:
    """``nbytes`` a tier will allocate for ``what``; ``fix`` is the advice when it does not fit.

    ``reclaimable_bytes``: bytes of the same kind that filling the tier frees (CPU weights moved into the
    CPU tier as it fills, or the old file the NVMe tier overwrites); ``path``: the NVMe folder."""

    tier: HostTier
    nbytes: int
    what: str
    fix: str = ""
    path: Optional[str] = None
    reclaimable_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class HostMemoryPlan:
    """The demands of every tier of one run, checked together (two tables in the CPU tier add up)."""

    demands: Sequence[TierDemand]
    reserve_bytes: int = HOST_RESERVE_BYTES

    def bytes_per_tier(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for d in self.demands:
            out[d.tier.value] = out.get(d.tier.value, 0) + int(d.nbytes)
        return out

    def check(self, resources: Optional[HostResources] = None) -> "HostMemoryPlan":
        """Raise :class:`CapacityError` naming the tier, the bytes needed and free, and the fix, when a tier
        does not fit; returns the plan. ``resources`` defaults to :meth:`HostResources.probe`."""
        if resources is None:
            resources = HostResources.probe([d.path for d in self.demands if d.tier == HostTier.NVME and d.path])
        groups: Dict[tuple, List[TierDemand]] = {}
        for d in self.demands:
            key = (d.tier, os.path.abspath(d.path) if d.tier == HostTier.NVME and d.path else None)
            groups.setdefault(key, []).append(d)
        for (tier, path), ds in groups.items():
            need = sum(int(d.nbytes) for d in ds)
            reclaim = sum(int(d.reclaimable_bytes) for d in ds)
            if tier == HostTier.CPU:
                free, where = resources.mem_available_bytes, "MemAvailable in /proc/meminfo"
                reserve = self.reserve_bytes
            elif tier == HostTier.SHM:
                free, where, reserve = resources.shm_free_bytes, f"free space of {SHM_PATH}", 0
            else:
                free, where, reserve = resources.disk_free_bytes.get(path), f"free space of {path}", 0
            if free is None or need - reclaim + reserve <= free:
                continue
            whats = "; ".join(f"{d.what}: {_gib(d.nbytes)}" for d in ds)
            fixes = "; ".join(dict.fromkeys(d.fix for d in ds if d.fix))
            freed = f", counting {_gib(reclaim)} that filling it frees" if reclaim else ""
            kept = f" and {_gib(reserve)} kept free for the process" if reserve else ""
            raise CapacityError(f"the {tier.value} tier needs {_gib(need)} ({whats}){kept}, but this host has "
                                f"{_gib(free)} ({where}{freed}); short by {_gib(need - reclaim + reserve - free)}. "
                                f"Nothing was allocated. Fix: {fixes or 'free memory or disk space'}")
        return self


# -- the memory ------------------------------------------------------------------------------------------
class _Mapping(mmap.mmap):
    """Anonymous memory that unregisters itself from CUDA before it is unmapped."""

    registered_ptr: Optional[int] = None

    def __del__(self):
        ptr, self.registered_ptr = self.registered_ptr, None
        if ptr is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            except Exception:  # interpreter shutdown: the driver releases it with the process
                pass


def host_tensor(shape: Sequence[int], dtype: torch.dtype = torch.float32, pin: bool = False,
                init: Optional[Callable[[torch.Tensor], object]] = None) -> torch.Tensor:
    """A contiguous CPU tensor of ``shape``: zeros, or whatever ``init(t)`` writes into it; page-locked
    after ``init`` when ``pin`` and CUDA is available (exact size, no power-of-two rounding).

    ``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds every
    request up to a power of two (11.3 GB takes 16 GiB) and has the driver fault in and lock every page from
    one thread before the data is written. This maps exactly the bytes asked for (private anonymous memory:
    zeros, no page touched yet, huge pages where the kernel allows; not inherited by forked workers once
    pinned), lets ``init`` fill it with ordinary multi-threaded torch copies (which fault the pages in
    parallel), and only then registers it with ``cudaHostRegister``, so H2D/D2H copies from it are
    asynchronous DMA like from any pinned tensor. The registration is undone when the last view is freed.
    A request larger than the host's free memory is refused before anything is mapped.

    >>> t = host_tensor((2, 3), torch.float32, init=lambda t: t.copy_(torch.ones(2, 3)))
    >>> t.shape, float(t.sum()), host_tensor((4,), torch.bfloat16).abs().sum().item()
    (torch.Size([2, 3]), 6.0, 0.0)
    """
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        if s < 0:
            raise ValueError(f"host_tensor shape {shape} has a negative size")
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    HostMemoryPlan([TierDemand(HostTier.CPU, nbytes, f"a {shape} {dtype} table",
                               fix="use the NVMe tier (offload.device = 'nvme') or fewer experts")],
                   reserve_bytes=0).check(HostResources(mem_available_bytes=mem_available_bytes()))
    # private anonymous memory: ordinary pages (transparent huge pages allowed), unlike mmap's default shared map
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_ANONYMOUS") else {}
    try:
        buf = _Mapping(-1, nbytes, **private)
    except (OSError, ValueError) as e:
        raise CapacityError(f"cannot map {_gib(nbytes)} of CPU memory for a {tuple(shape)} {dtype} "
                            f"table ({e}); use the NVMe tier (offload.device = 'nvme') or fewer experts") from e
    try:  # 2 MiB pages where the kernel allows: 512x fewer page faults when the table is first written
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # not Linux, or a kernel without transparent huge pages
        pass
    t = torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)  # keeps buf alive: unmapped with its last view
    if init is not None:
        init(t)
    if pin and torch.cuda.is_available():
        if init is None:
            t.zero_()  # fault the pages in with every thread; registering untouched memory faults them in one
        try:  # a fork (DataLoader workers) would otherwise copy every DMA-pinned private page into the child
            buf.madvise(mmap.MADV_DONTFORK)
        except (AttributeError, OSError):
            pass
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, HOST_REGISTER_PORTABLE)
        if int(rc) != 0:
            raise CapacityError(f"cudaHostRegister of {_gib(nbytes)} failed (cudaError {int(rc)}): the "
                                "pinned CPU tier does not fit (ulimit -l, RAM); set offload.pin_memory false "
                                "or use the NVMe tier")
        buf.registered_ptr = t.data_ptr()
    return t


class PiecedHostTable:
    """``num_rows`` rows of ``row_numel`` elements in CPU memory, mapped in pieces of whole rows.

    Each piece (``rows_per_piece`` rows, about ``piece_bytes``) is one :func:`host_tensor`, allocated
    (and page-locked when ``pin``) the first time one of its rows is asked for, so a table filled row by
    row from weights that are freed as they are copied never holds both at once. ``row(i)`` is a view of
    one contiguous buffer. ``piece_bytes`` defaults to :data:`PIECE_BYTES`.
    """

    def __init__(self, num_rows: int, row_numel: int, dtype: torch.dtype, pin: bool = False,
                 piece_bytes: Optional[int] = None):
        piece_bytes = PIECE_BYTES if piece_bytes is None else piece_bytes
        if int(num_rows) < 0 or int(row_numel) < 0:
            raise ValueError(f"a host table of {num_rows} rows of {row_numel} elements: both must be >= 0")
        self.num_rows = int(num_rows)
        self.row_numel = int(row_numel)
        self.dtype = dtype
        self.pin = bool(pin)
        self.row_bytes = self.row_numel * torch.empty((), dtype=dtype).element_size()
        self.rows_per_piece = max(1, min(self.num_rows, int(piece_bytes) // max(1, self.row_bytes)))
        self.num_pieces = -(-self.num_rows // self.rows_per_piece) if self.num_rows else 0
        self._pieces: List[Optional[torch.Tensor]] = [None] * self.num_pieces

    @classmethod
    def wrap(cls, table: torch.Tensor) -> "PiecedHostTable":
        """A table of one piece: the given contiguous CPU tensor ``[rows, row_numel]`` (used as it is)."""
        if table.dim() != 2 or table.device.type != "cpu" or not table.is_contiguous():
            raise ValueError(f"PiecedHostTable.wrap takes a contiguous [rows, row_numel] CPU tensor, got "
                             f"{tuple(table.shape)} on {table.device}")
        out = cls(table.shape[0], table.shape[1], table.dtype, pin=table.is_pinned(),
                  piece_bytes=max(1, table.numel() * table.element_size()))
        out._pieces = [table] if out.num_pieces else []
        return out

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def allocated_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._pieces if p is not None)

    def piece(self, index: int) -> torch.Tensor:
        """Piece ``index`` (``[rows, row_numel]``), allocated zeroed on first use."""
        p = self._pieces[index]
        if p is None:
            rows = min(self.rows_per_piece, self.num_rows - index * self.rows_per_piece)
            p = self._pieces[index] = host_tensor((rows, self.row_numel), self.dtype, pin=self.pin)
        return p

    def piece_range(self, index: int) -> Tuple[int, int]:
        """Rows ``[lo, hi)`` of piece ``index``."""
        lo = index * self.rows_per_piece
        return lo, min(self.num_rows, lo + self.rows_per_piece)

    @property
    def whole(self) -> Optional[torch.Tensor]:
        """The table as one tensor ``[num_rows, row_numel]`` when it is one piece (or empty), else ``None``."""
        if self.num_pieces == 0:
            return torch.empty(0, self.row_numel, dtype=self.dtype)
        return self.piece(0) if self.num_pieces == 1 else None

    def row(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.num_rows:
            raise IndexError(f"row {i} is out of range for a table of {self.num_rows} rows")
        return self.piece(i // self.rows_per_piece)[i % self.rows_per_piece]

    def release(self) -> None:
        """Drop every piece: its memory is unmapped (and unregistered) once no view of it is left, and a piece
        asked for again is mapped anew, zeroed."""
        self._pieces = [None] * self.num_pieces


def pinned_empty(shape: Sequence[int], dtype: torch.dtype = torch.float32, pin: bool = True) -> torch.Tensor:
    """An uninitialized CPU tensor, page-locked when ``pin`` and CUDA is available, from PyTorch's caching host
    allocator: for short-lived buffers made over and over (staging, a gradient copied off the device), which that
    allocator reuses once they are freed and holds back while a non-blocking copy still uses them. Long-lived
    tables take :func:`host_tensor` or :class:`PiecedHostTable` (exact size, registered once) instead.

    >>> t = pinned_empty((2, 3), torch.bfloat16, pin=False)
    >>> t.shape, t.dtype, t.is_pinned()
    (torch.Size([2, 3]), torch.bfloat16, False)
    """
    return torch.empty(tuple(int(s) for s in shape), dtype=dtype, pin_memory=bool(pin and torch.cuda.is_available()))


def check_cpu_tier(nbytes: int, what: str, fix: str) -> None:
    """Refuse, before anything is allocated, a CPU-tier table of ``nbytes`` that this host's free memory
    cannot hold (a :class:`CapacityError` with the numbers and ``fix``); a no-op where free memory is unknown.

    >>> check_cpu_tier(1024, "a tiny table", "use the NVMe tier")
    """
    HostMemoryPlan([TierDemand(HostTier.CPU, int(nbytes), what, fix=fix)]).check()
