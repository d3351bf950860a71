"""Shard files: safetensors with the tensor data on a 4096-byte boundary, written atomically.

A shard file is an ordinary safetensors file (8-byte little-endian header length, JSON header,
data) whose JSON header is padded with spaces so the data starts at a multiple of
:data:`ALIGN_BYTES`; the async loader can then read the data region with ``O_DIRECT`` and any
safetensors tool still opens the file. Tensors follow each other with no gaps (safetensors forbids
holes), in the order they were given.

Writes go to a hidden temporary file in the same folder, are fsynced, renamed over the target and
the folder is fsynced: a crash leaves either the old file or the new one, never a mix.
"""
from __future__ import annotations

import errno
import json
import os
import struct
import uuid
import zlib
from typing import Dict, Iterable, List, Tuple

import torch

from ds_maximus.errors import ShardStoreError

ALIGN_BYTES = 4096  # data offset alignment of shard files (bytes); O_DIRECT needs the block size
MAX_HEADER_BYTES = 100 << 20  # a header longer than this is corrupt, not real

DTYPE_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}
DTYPE_NAMES = {str(d).replace("torch.", ""): d for d in DTYPE_TO_ST}


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; raises ShardStoreError for a dtype shards cannot hold."""
    if isinstance(name, torch.dtype):
        name = str(name).replace("torch.", "")
    try:
        return DTYPE_NAMES[name]
    except KeyError:
        raise ShardStoreError(f"unsupported shard dtype {name!r}; allowed: {sorted(DTYPE_NAMES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype_from_name(dtype)).replace("torch.", "")


class ShardHeader:
    """The parsed header of a shard file: tensor name -> (dtype, shape, start, end) and its metadata."""

    def __init__(self, tensors: Dict[str, Tuple[torch.dtype, List[int], int, int]], data_offset: int,
                 metadata: Dict[str, str]):
        self.tensors = tensors
        self.data_offset = data_offset
        self.metadata = metadata

    @property
    def data_bytes(self) -> int:
        return max((t[3] for t in self.tensors.values()), default=0)


def build_header(tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> Tuple[bytes, int]:
    """The padded header bytes (length prefix included) and the number of data bytes that follow."""
    entries: Dict[str, object] = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    pos = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": DTYPE_TO_ST[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    body = json.dumps(entries, separators=(",", ":")).encode()
    pad = (-(8 + len(body))) % ALIGN_BYTES
    body += b" " * pad
    return struct.pack("<Q", len(body)) + body, pos


def parse_header(raw: bytes, path: str, file_bytes: int) -> ShardHeader:
    """Parse and check the header of a shard file; the first 8 bytes of ``raw`` are the length."""
    if len(raw) < 8:
        raise ShardStoreError(f"shard file {path} is torn: {len(raw)} bytes, shorter than the 8-byte header "
                              "length; rewrite the shard or restore it from a backup", path)
    (n,) = struct.unpack("<Q", raw[:8])
    if n > MAX_HEADER_BYTES or 8 + n > file_bytes:
        raise ShardStoreError(f"shard file {path} is torn or corrupt: header length {n} does not fit in "
                              f"{file_bytes} bytes; rewrite the shard or restore it from a backup", path)
    if len(raw) < 8 + n:
        raise ShardStoreError(f"shard file {path}: header read short ({len(raw)} of {8 + n} bytes)", path)
    try:
        entries = json.loads(raw[8:8 + n].decode())
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, or a number of over 4300 digits
        raise ShardStoreError(f"shard file {path} has a corrupt JSON header ({e}); restore the shard", path) from None
    if not isinstance(entries, dict):
        raise ShardStoreError(f"shard file {path} has a corrupt header (not a JSON object)", path)
    metadata = entries.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ShardStoreError(f"shard file {path} has a corrupt header: __metadata__ must map names to strings", path)
    tensors = {name: _tensor_entry(name, e, path, file_bytes) for name, e in entries.items()}
    head = ShardHeader(tensors, 8 + n, metadata)
    if head.data_offset + head.data_bytes != file_bytes:
        raise ShardStoreError(f"shard file {path} is torn: header promises {head.data_offset + head.data_bytes} "
                              f"bytes, the file has {file_bytes}; rewrite the shard or restore it", path)
    return head


def _tensor_entry(name: str, e, path: str, file_bytes: int) -> Tuple[torch.dtype, List[int], int, int]:
    """One tensor of a header, each number checked for type and range: a known dtype, a shape of at most 8
    non-negative ints, and data offsets inside the file whose span is exactly the shape's bytes."""
    def bad(why: str):
        return ShardStoreError(f"shard file {path} has a corrupt header entry {name!r:.80}: {why}; restore the "
                               "shard or rewrite it", path)

    if not isinstance(e, dict):
        raise bad(f"expected an object, got {type(e).__name__}")
    dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ST_TO_DTYPE:
        raise bad(f"dtype {dtype!r:.40} is not one of {sorted(ST_TO_DTYPE)}")
    if (not isinstance(shape, list) or len(shape) > 8
            or not all(type(x) is int and 0 <= x <= file_bytes for x in shape)):
        raise bad(f"shape {shape!r:.80} is not a list of at most 8 non-negative integers")
    if (not isinstance(offs, list) or len(offs) != 2 or not all(type(x) is int for x in offs)
            or not 0 <= offs[0] <= offs[1] <= file_bytes):
        raise bad(f"data_offsets {offs!r:.80} is not [start, end] with 0 <= start <= end <= {file_bytes}")
    numel = 1
    for x in shape:
        numel *= x
    if numel * ST_TO_DTYPE[dtype].itemsize != offs[1] - offs[0]:
        raise bad(f"shape {shape} of {dtype} needs {numel * ST_TO_DTYPE[dtype].itemsize} bytes, data_offsets span "
                  f"{offs[1] - offs[0]}")
    return ST_TO_DTYPE[dtype], shape, offs[0], offs[1]


def checksum(chunks: Iterable) -> str:
    """crc32 over the data bytes (buffers or tensors), as ``"crc32:xxxxxxxx"``."""
    c = 0
    for ch in chunks:
        c = zlib.crc32(_as_buffer(ch), c)
    return f"crc32:{c:08x}"


def _as_buffer(x):
    if isinstance(x, torch.Tensor):
        return x.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return x


def _write_all(fd: int, buf) -> None:
    """Write every byte of ``buf`` to ``fd`` (tests patch this to simulate a full disk)."""
    mv = memoryview(buf).cast("B")
    while len(mv):
        n = os.write(fd, mv[: 1 << 26])
        mv = mv[n:]


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, chunks: Iterable) -> int:
    """Write ``chunks`` (bytes or tensors) to ``path`` atomically; returns the bytes written.

    A failure (a full disk included) removes the temporary file, leaves any old ``path`` untouched
    and raises :class:`ShardStoreError` naming the file and the cause.
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    total = 0
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for ch in chunks:
                buf = _as_buffer(ch)
                _write_all(fd, buf)
                total += memoryview(buf).nbytes
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(folder)
    except OSError as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ShardStoreError(f"disk full while writing {path} ({e.strerror}); the previous file is intact; "
                                  f"free space on {folder} and retry", path) from e
        raise ShardStoreError(f"could not write {path}: {e}; the previous file is intact", path) from e
    return total


def write_shard_file(path: str, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> Tuple[int, int, str]:
    """Write one shard file atomically; returns (file bytes, data offset, data checksum)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    header, _ = build_header(tensors, metadata)
    total = atomic_write(path, [header, *tensors.values()])
    return total, len(header), checksum(tensors.values())
