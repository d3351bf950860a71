"""``ShardStore``: a vocabulary table (and its optimizer state) on disk, one safetensors file per shard.

The store is a folder holding ``shard_index.json`` and one file per shard of ``rows_per_shard``
rows (the last shard, and shards added by :meth:`ShardStore.append_shards`, may be shorter). Each
shard file holds ``"weight"`` and one tensor per optimizer-state name, all ``[rows, dim]`` in the
store dtype, with the data on a 4096-byte boundary (see :mod:`ds_maximus.store.format`).

Crash safety: a rewritten shard goes to a *new* file name; only when it is on disk is the index
switched to it (atomically), and then the old file is deleted. A crash at any point leaves an index
whose every file is whole; at worst an orphan file remains (:meth:`ShardStore.verify` lists it,
:meth:`ShardStore.remove_orphans` deletes it; a run's NVMe tier does so when it opens the store).

Trust: ``shard_index.json`` is validated field by field when the store is opened (see
:func:`ds_maximus.store.index.validate_index`) and every shard file's header before its data is read, so a
tampered or corrupt store is a ShardStoreError naming the field, never a read or write outside the folder.
"""
from __future__ import annotations

import os
import re
import threading
import uuid
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ds_maximus.errors import NVMeIOError, ShardStoreError
from ds_maximus.store.format import checksum, dtype_from_name, dtype_name, parse_header, write_shard_file
from ds_maximus.store.index import INDEX_NAME, SHARD_FILE_RE, ShardInfo, StoreIndex, shard_file_path

InitFn = Callable[[int, int], Dict[str, torch.Tensor]]
LoaderArg = Union[None, bool, object]

_default_loader = None
_default_loader_lock = threading.Lock()


def default_loader():
    """The process-wide ``NVMeLoader`` when the op is available here, else ``None`` (plain reads)."""
    global _default_loader
    with _default_loader_lock:
        if _default_loader is None:
            try:
                from ds_maximus.ops.nvme_loader import NVMeLoader, nvme_loader_available
                _default_loader = NVMeLoader() if nvme_loader_available() else False
            except Exception:  # op missing or not buildable here: plain reads
                _default_loader = False
        return _default_loader or None


# The temporary files of atomic_write in a store folder: ".<target>.tmp-<pid>-<hex>".
_TMP_FILE_RE = re.compile(r"\.(?:shard_[0-9]{6,12}-[0-9a-f]{8}\.safetensors|shard_index\.json)\.tmp-([0-9]+)-[0-9a-f]+")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _shard_file_name(i: int) -> str:
    return f"shard_{i:06d}-{uuid.uuid4().hex[:8]}.safetensors"


class ShardStore:
    """A vocab-sized table on disk, read and written shard by shard.

    Example::

        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> store = ShardStore.create(d + "/emb", vocab_size=10, dim=4, rows_per_shard=4, state_names=("exp_avg",))
        >>> store.num_shards, store.shard_range(2)
        (3, (8, 10))
        >>> store.write_shard(1, {"weight": torch.ones(4, 4)})   # exp_avg kept as it was
        >>> ShardStore.open(d + "/emb").read_shard(1)["weight"].sum().item()
        16.0
        >>> store.shard_of(torch.tensor([0, 5, 9])).tolist()
        [0, 1, 2]

    ``loader``: ``None`` reads through the async NVMe loader when its op is available and with
    plain reads otherwise; ``False`` forces plain reads; any object with ``read_into(path, offset,
    tensor) -> handle`` (``handle.wait()``) is used as given.
    """

    def __init__(self, path: str, index: StoreIndex, loader: LoaderArg = None, verify_checksums: bool = True):
        self.path = os.path.abspath(path)
        self._index = index
        self._loader = default_loader() if loader is None else (loader or None)
        self.verify_checksums = verify_checksums
        self._lock = threading.RLock()
        self._refresh()

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str, vocab_size: int, dim: int, dtype: torch.dtype = torch.float32,
               rows_per_shard: int = 32768, state_names: Sequence[str] = (), init: Optional[InitFn] = None,
               loader: LoaderArg = None, overwrite: bool = False, progress: bool = False) -> "ShardStore":
        """Create a store at ``path`` and write every shard; ``init(lo, hi)`` gives the tensors of rows
        ``[lo, hi)`` by name (``"weight"`` and state names; any left out are zeros). ``vocab_size=0`` makes an
        empty store that :meth:`append_shards` grows."""
        for name, v, least in (("vocab_size", vocab_size, 0), ("dim", dim, 1), ("rows_per_shard", rows_per_shard, 1)):
            if int(v) < least:
                raise ShardStoreError(f"ShardStore.create: {name}={v}; it must be >= {least}", path)
        state_names = tuple(state_names)
        if "weight" in state_names or len(set(state_names)) != len(state_names):
            raise ShardStoreError(f"state_names {state_names} must be unique and must not contain 'weight'", path)
        os.makedirs(path, exist_ok=True)
        if os.path.exists(os.path.join(path, INDEX_NAME)) and not overwrite:
            raise ShardStoreError(f"{path} already holds a shard store; open it with ShardStore.open, or pass "
                                  "overwrite=True to replace it", path)
        index = StoreIndex(0, int(dim), dtype_name(dtype), int(rows_per_shard), state_names, [])
        store = cls(path, index, loader=loader)
        n_shards = -(-vocab_size // rows_per_shard)
        ranges = [(i * rows_per_shard, min(vocab_size, (i + 1) * rows_per_shard)) for i in range(n_shards)]
        it = ranges
        if progress:
            from tqdm.auto import tqdm
            it = tqdm(ranges, desc="writing shards", unit="shard")
        infos = []
        for i, (lo, hi) in enumerate(it):
            given = dict(init(lo, hi)) if init is not None else {}
            infos.append(store._write_new_file(i, lo, hi, given, old=None))
        index.shards, index.vocab_size = infos, int(vocab_size)
        index.save(store.path)
        store._refresh()
        store.remove_orphans()  # the files of a store replaced here (overwrite) or left by a crashed create
        return store

    @classmethod
    def open(cls, path: str, loader: LoaderArg = None, verify_checksums: bool = True) -> "ShardStore":
        """Open an existing store (the index is read and checked; shard files are read on demand)."""
        return cls(path, StoreIndex.load(os.path.abspath(path)), loader=loader, verify_checksums=verify_checksums)

    # ---- attributes ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._index.vocab_size

    @property
    def dim(self) -> int:
        return self._index.dim

    @property
    def dtype(self) -> torch.dtype:
        return dtype_from_name(self._index.dtype)

    @property
    def rows_per_shard(self) -> int:
        return self._index.rows_per_shard

    @property
    def num_shards(self) -> int:
        return len(self._index.shards)

    @property
    def state_names(self) -> Tuple[str, ...]:
        return self._index.state_names

    @property
    def tensor_names(self) -> Tuple[str, ...]:
        return ("weight",) + self.state_names

    @property
    def uses_loader(self) -> bool:
        """True when reads go through the async NVMe loader."""
        return self._loader is not None

    def shard_info(self, i: int) -> ShardInfo:
        return self._index.shards[self._check_id(i)]

    def shard_range(self, i: int) -> Tuple[int, int]:
        s = self.shard_info(i)
        return s.lo, s.hi

    def shard_path(self, i: int) -> str:
        return self._file_path(self.shard_info(i))

    def tensor_location(self, i: int, name: str = "weight") -> Tuple[str, int, int]:
        """``(path, file offset, nbytes)`` of one tensor of shard ``i``, for direct (O_DIRECT/GPU) reads."""
        s = self.shard_info(i)
        names = self.tensor_names
        if name not in names:
            raise KeyError(f"tensor {name!r} is not in the store; it holds {names}")
        nb = s.rows * self.dim * self.dtype.itemsize
        return self._file_path(s), s.data_offset + names.index(name) * nb, nb

    def shard_of(self, rows: torch.Tensor) -> torch.Tensor:
        """Shard id of each row id (LongTensor in, LongTensor out)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.vocab_size):
            bad = rows[(rows < 0) | (rows >= self.vocab_size)][0].item()
            raise IndexError(f"row id {bad} is out of range for a store of vocab_size {self.vocab_size}")
        return torch.searchsorted(self._his, rows.to(self._his.device), right=True)

    def access_counts(self) -> List[int]:
        return [s.access_count for s in self._index.shards]

    # ---- reading ------------------------------------------------------------------------------
    def read_shard(self, i: int, verify: Optional[bool] = None) -> Dict[str, torch.Tensor]:
        """``{"weight": [hi-lo, dim], <state name>: [hi-lo, dim], ...}`` of shard ``i``.

        ``verify`` (default: the store's ``verify_checksums``) checks the data checksum.
        """
        info = self.shard_info(i)
        buf = _read_buffer(info.bytes - info.data_offset, self._loader is not None)
        self.read_shard_into(i, buf, verify)
        out, pos, nb = {}, 0, info.rows * self.dim * self.dtype.itemsize
        for name in self.tensor_names:
            out[name] = buf[pos:pos + nb].view(self.dtype).view(info.rows, self.dim)
            pos += nb
        return out

    def read_shard_into(self, i: int, dst: torch.Tensor, verify: Optional[bool] = None) -> None:
        """Read shard ``i``'s data (its tensors in :attr:`tensor_names` order, back to back) into ``dst``, a
        contiguous CPU tensor of exactly that many bytes, with no intermediate buffer (the loader reads straight
        into it); the file's size and header are checked first, the checksum when ``verify``."""
        info = self.shard_info(i)
        path = self._file_path(info)
        data_offset = self._check_file(info, path)
        nbytes = info.bytes - data_offset
        if dst.device.type != "cpu" or not dst.is_contiguous() or dst.numel() * dst.element_size() != nbytes:
            raise ValueError(f"read_shard_into({i}): dst must be a contiguous CPU tensor of {nbytes} bytes, got "
                             f"{tuple(dst.shape)} {dst.dtype} on {dst.device}")
        buf = dst.view(-1).view(torch.uint8) if nbytes else dst
        if self._loader is not None and nbytes:
            try:
                self._loader.read_into(path, data_offset, buf).wait()
            except NVMeIOError as e:
                raise ShardStoreError(f"reading shard {i} from {path} failed: {e}", path) from e
        else:
            _pread_into(path, data_offset, buf)
        if self.verify_checksums if verify is None else verify:
            got = checksum([buf])
            if got != info.checksum:
                raise ShardStoreError(f"shard file {path} is corrupt: data checksum {got} != {info.checksum} in "
                                      f"{INDEX_NAME}; restore the file or rewrite shard {i}", path)
        with self._lock:
            info.access_count += 1

    def iter_shards(self) -> Iterator[Tuple[int, Dict[str, torch.Tensor]]]:
        """Yield ``(shard id, tensors)`` for every shard, in order."""
        for i in range(self.num_shards):
            yield i, self.read_shard(i)

    def read_rows(self, rows: torch.Tensor, name: str = "weight") -> torch.Tensor:
        """Rows ``rows`` of tensor ``name`` as a ``[len(rows), dim]`` tensor (reads the shards they lie in)."""
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        out = torch.empty(rows.numel(), self.dim, dtype=self.dtype)
        shards = self.shard_of(rows)
        for i in torch.unique(shards).tolist():
            sel = (shards == i).nonzero().squeeze(1)
            out[sel] = self.read_shard(i)[name][rows[sel] - self.shard_info(i).lo]
        return out

    def read_all(self, name: str = "weight") -> torch.Tensor:
        """The whole ``[vocab_size, dim]`` tensor ``name`` (only for tables that fit in memory)."""
        return torch.cat([t[name] for _, t in self.iter_shards()]) if self.num_shards else \
            torch.empty(0, self.dim, dtype=self.dtype)

    # ---- writing ------------------------------------------------------------------------------
    def write_shard(self, i: int, tensors: Dict[str, torch.Tensor]) -> None:
        """Replace shard ``i`` atomically. Tensors left out keep their stored values."""
        with self._lock:
            info = self.shard_info(i)
            unknown = set(tensors) - set(self.tensor_names)
            if unknown:
                raise ShardStoreError(f"write_shard({i}): unknown tensors {sorted(unknown)}; the store holds "
                                      f"{self.tensor_names}", self.path)
            given = dict(tensors)
            if set(given) != set(self.tensor_names):
                old = self.read_shard(i)
                given = {k: given.get(k, old[k]) for k in self.tensor_names}
            new = self._write_new_file(i, info.lo, info.hi, given, old=info)
            self._commit([(i, new)], old_files=[info.file])

    def append_shards(self, tensors: Dict[str, torch.Tensor]) -> List[int]:
        """Grow the table by ``tensors["weight"].shape[0]`` rows as new shards (old shards untouched).

        Returns the new shard ids. State tensors left out start at zero.
        """
        with self._lock:
            if "weight" not in tensors:
                raise ShardStoreError("append_shards needs a 'weight' tensor of the new rows", self.path)
            n = int(tensors["weight"].shape[0])
            unknown = set(tensors) - set(self.tensor_names)
            if unknown:
                raise ShardStoreError(f"append_shards: unknown tensors {sorted(unknown)}; the store holds "
                                      f"{self.tensor_names}", self.path)
            base, ids, news = self.vocab_size, [], []
            for off in range(0, n, self.rows_per_shard):
                end = min(n, off + self.rows_per_shard)
                i = self.num_shards + len(ids)
                part = {k: v[off:end] for k, v in tensors.items()}
                news.append((i, self._write_new_file(i, base + off, base + end, part, old=None)))
                ids.append(i)
            self._commit(news, old_files=[], vocab_size=base + n)
            return ids

    def rewrite(self, init: InitFn) -> None:
        """Replace every shard's tensors with ``init(lo, hi)`` (tensors left out are zeros), shard by shard.

        Each shard is written to a new file and committed before the next (see :meth:`write_shard`), so disk
        use peaks at the table plus one shard, and a crash leaves every shard whole (old or new).
        """
        for i in range(self.num_shards):
            lo, hi = self.shard_range(i)
            given = dict(init(lo, hi))
            self.write_shard(i, {n: given.get(n, torch.zeros(hi - lo, self.dim, dtype=self.dtype))
                                 for n in self.tensor_names})

    def flush_index(self) -> None:
        """Persist the access counts (they are kept in memory between writes)."""
        with self._lock:
            self._index.save(self.path)

    # ---- checking -----------------------------------------------------------------------------
    def verify(self) -> Dict[str, object]:
        """Read every shard and check sizes, headers and checksums.

        Returns ``{"shards", "bytes", "orphans"}``; raises ShardStoreError listing every problem.
        """
        problems, total = [], 0
        for i in range(self.num_shards):
            try:
                self.read_shard(i, verify=True)
                total += self.shard_info(i).bytes
            except ShardStoreError as e:
                problems.append(str(e))
        if problems:
            raise ShardStoreError(f"shard store {self.path} failed verification ({len(problems)} of "
                                  f"{self.num_shards} shards):\n  " + "\n  ".join(problems), self.path)
        return {"shards": self.num_shards, "bytes": total, "orphans": self._orphans()}

    def remove_orphans(self) -> List[str]:
        """Delete shard files the index does not name and temporary files of writers that are no longer running
        (left by interrupted writes or by a replaced store); returns their names. Only names of the store's own
        pattern are touched. Call when no other process writes this store."""
        with self._lock:
            orphans = self._orphans(live_tmps=False)
            for f in orphans:
                _unlink_quiet(os.path.join(self.path, f))
            return orphans

    def __repr__(self) -> str:
        return (f"ShardStore({self.path!r}, vocab_size={self.vocab_size}, dim={self.dim}, dtype={self._index.dtype}, "
                f"shards={self.num_shards}, state_names={self.state_names})")

    # ---- internals ----------------------------------------------------------------------------
    def _check_id(self, i: int) -> int:
        i = int(i)
        if not 0 <= i < len(self._index.shards):
            raise IndexError(f"shard id {i} is out of range; the store has {len(self._index.shards)} shards")
        return i

    def _orphans(self, live_tmps: bool = True) -> List[str]:
        """Store-pattern files the index does not name; temporary files of live writers only if ``live_tmps``."""
        known = {s.file for s in self._index.shards}
        out = []
        for f in os.listdir(self.path):
            if SHARD_FILE_RE.fullmatch(f):
                if f not in known:
                    out.append(f)
                continue
            m = _TMP_FILE_RE.fullmatch(f)
            if m and (live_tmps or not _pid_alive(int(m.group(1)))):
                out.append(f)
        return sorted(out)

    def _refresh(self) -> None:
        self._his = torch.tensor([s.hi for s in self._index.shards], dtype=torch.long)

    def _file_path(self, info: ShardInfo) -> str:
        """The shard's file, checked again at use: a plain store file name that resolves inside the store."""
        return shard_file_path(self.path, info.file, os.path.join(self.path, INDEX_NAME))

    def _check_file(self, info: ShardInfo, path: str) -> int:
        """Check existence, size and header of a shard file; returns its data offset."""
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise ShardStoreError(f"shard file {path} (shard {info.id}, rows [{info.lo}, {info.hi})) named in "
                                  f"{INDEX_NAME} is missing; restore it or rebuild the store", path) from None
        if size != info.bytes:
            raise ShardStoreError(f"shard file {path} is torn: {size} bytes, {INDEX_NAME} says {info.bytes}; "
                                  f"restore it or rewrite shard {info.id}", path)
        with open(path, "rb") as f:
            raw = f.read(min(size, info.data_offset))
        head = parse_header(raw, path, size)
        shape = [info.rows, self.dim]
        want = {n: (self.dtype, shape) for n in self.tensor_names}
        got = {n: (t[0], t[1]) for n, t in head.tensors.items()}
        if got != want or list(head.tensors) != list(self.tensor_names) or head.data_offset != info.data_offset:
            raise ShardStoreError(f"shard file {path} does not match {INDEX_NAME}: it holds {got} at data offset "
                                  f"{head.data_offset}, expected {want} at {info.data_offset}", path)
        return head.data_offset

    def _write_new_file(self, i: int, lo: int, hi: int, given: Dict[str, torch.Tensor],
                        old: Optional[ShardInfo]) -> ShardInfo:
        rows, tensors = hi - lo, {}
        for name in self.tensor_names:
            t = given.get(name)
            if t is None:
                t = torch.zeros(rows, self.dim, dtype=self.dtype)
            t = torch.as_tensor(t)
            if tuple(t.shape) != (rows, self.dim):
                raise ShardStoreError(f"shard {i} tensor {name!r} has shape {tuple(t.shape)}; expected "
                                      f"({rows}, {self.dim}) for rows [{lo}, {hi})", self.path)
            tensors[name] = t.detach().to("cpu", self.dtype)
        fname = _shard_file_name(i)
        nbytes, data_offset, crc = write_shard_file(os.path.join(self.path, fname), tensors,
                                                    {"format": "ds_maximus.shard", "shard": i, "lo": lo, "hi": hi})
        return ShardInfo(i, lo, hi, fname, nbytes, data_offset, crc, old.access_count if old else 0)

    def _commit(self, news: List[Tuple[int, ShardInfo]], old_files: List[str],
                vocab_size: Optional[int] = None) -> None:
        """Switch the index to the new files (atomically), then delete the replaced files."""
        shards = list(self._index.shards)
        for i, info in news:
            if i < len(shards):
                shards[i] = info
            else:
                shards.append(info)
        new_index = StoreIndex(vocab_size if vocab_size is not None else self.vocab_size, self.dim,
                               self._index.dtype, self.rows_per_shard, self.state_names, shards)
        try:
            new_index.save(self.path)
        except ShardStoreError:
            for _, info in news:  # the index still names the old files: drop the new ones
                _unlink_quiet(os.path.join(self.path, info.file))
            raise
        self._index = new_index
        self._refresh()
        for f in old_files:
            _unlink_quiet(os.path.join(self.path, f))


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _read_buffer(nbytes: int, for_loader: bool) -> torch.Tensor:
    """A uint8 buffer of ``nbytes``; page-aligned (pinned with CUDA) for the loader, so O_DIRECT needs no
    bounce buffer."""
    if for_loader:
        try:
            from ds_maximus.ops.nvme_loader import aligned_empty
            return aligned_empty(nbytes)
        except ImportError:
            pass
    return torch.empty(nbytes, dtype=torch.uint8)


def _pread_into(path: str, offset: int, buf: torch.Tensor) -> None:
    """Plain buffered read of ``buf.nbytes`` bytes at ``offset`` into ``buf`` (no extra copy)."""
    mv = memoryview(buf.numpy()).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = 0
        while pos < len(mv):
            n = os.preadv(fd, [mv[pos:pos + (1 << 30)]], offset + pos)
            if n == 0:
                raise ShardStoreError(f"shard file {path} is torn: read ended at byte {offset + pos} of "
                                      f"{offset + len(mv)}", path)
            pos += n
    finally:
        os.close(fd)
