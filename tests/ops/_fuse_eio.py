"""A tiny FUSE file system, spoken directly over /dev/fuse (no libfuse), whose one file fails every
read with EIO: the only way to get a real EIO from the kernel on a machine without device-mapper.

    with eio_mount(tmp_path / "mnt") as path:   # path: a 1 MiB file whose reads fail with EIO
        ...
Needs root and /dev/fuse; raises OSError where it cannot mount (tests skip then).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import struct
import threading

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
OUT_HEADER = struct.Struct("<IiQ")       # len, error, unique
# ino size blocks atime mtime ctime, 3 nsec, mode nlink uid gid rdev blksize flags
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
LOOKUP, FORGET, GETATTR, OPEN, READ, RELEASE, FLUSH, INIT, BATCH_FORGET = 1, 2, 3, 14, 15, 18, 25, 26, 42
FILE_NAME, FILE_BYTES, ROOT, FILE = "bad.bin", 1 << 20, 1, 2


def _attr(node: int) -> bytes:
    if node == ROOT:
        return ATTR.pack(ROOT, 0, 0, 0, 0, 0, 0, 0, 0, stat.S_IFDIR | 0o755, 2, 0, 0, 0, 4096, 0)
    return ATTR.pack(FILE, FILE_BYTES, FILE_BYTES // 512, 0, 0, 0, 0, 0, 0, stat.S_IFREG | 0o644, 1, 0, 0, 0, 4096, 0)


def _serve(fd: int):
    def reply(unique, err=0, body=b""):
        os.write(fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), -err, unique) + body)

    while True:
        try:
            msg = os.read(fd, (1 << 20) + 4096)
        except OSError:  # ENODEV once unmounted
            return
        _, op, unique, node, *_ = IN_HEADER.unpack_from(msg)
        arg = msg[IN_HEADER.size:]
        try:
            if op in (FORGET, BATCH_FORGET):
                continue  # no reply expected
            if op == INIT:
                major, minor = struct.unpack_from("<II", arg)
                body = struct.pack("<IIIIHHIIHHII", 7, min(minor, 31), 0, 0, 16, 12, 128 << 10, 1, 0, 0, 0, 0)
                reply(unique, body=body + bytes(64 - len(body)))
            elif op == LOOKUP:
                if node == ROOT and arg.split(b"\0")[0].decode() == FILE_NAME:
                    reply(unique, body=struct.pack("<QQQQII", FILE, 0, 1, 1, 0, 0) + _attr(FILE))
                else:
                    reply(unique, errno.ENOENT)
            elif op == GETATTR:
                reply(unique, body=struct.pack("<QII", 1, 0, 0) + _attr(node))
            elif op == OPEN:
                reply(unique, body=struct.pack("<QII", 1, 0, 0))
            elif op == READ:
                reply(unique, errno.EIO)  # the point of it all
            elif op in (RELEASE, FLUSH):
                reply(unique)
            else:
                reply(unique, errno.ENOSYS)
        except OSError:  # the request was interrupted/aborted meanwhile
            pass


@contextlib.contextmanager
def eio_mount(folder):
    """Mount the EIO file system on ``folder``; yields the path of its one file."""
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    fd = os.open("/dev/fuse", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"fd={fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()}".encode()
    if libc.mount(b"maximus_eio", folder.encode(), b"fuse", 0, opts) != 0:
        e = ctypes.get_errno()
        os.close(fd)
        raise OSError(e, f"mount of a FUSE file system on {folder} failed: {os.strerror(e)}")
    server = threading.Thread(target=_serve, args=(fd,), daemon=True)
    server.start()
    try:
        yield os.path.join(folder, FILE_NAME)
    finally:
        libc.umount2(folder.encode(), 2)  # MNT_DETACH
        os.close(fd)
        server.join(timeout=5)
