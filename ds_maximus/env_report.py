"""``python -m ds_maximus.env_report [--nvme-path DIR] [--build]``: what this machine can do for maximus.

Prints versions (torch, DeepSpeed, CUDA), each maximus op with compatible / built status (and the
reason when incompatible), the JIT cache folder, and the free space and O_DIRECT support of an
NVMe path.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import io
import os
import re
import shutil
import sys
import tempfile
from typing import List, Tuple


def builders():
    """One instance of every maximus op builder (every builder class in ``op_builder/``)."""
    import pkgutil

    from ds_maximus.ops import op_builder_module
    pkg = op_builder_module()
    from ds_maximus.op_builder.builder import MaximusCUDAOpBuilder, MaximusOpBuilder
    found = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name == "builder":
            continue
        mod = importlib.import_module(f"ds_maximus.op_builder.{info.name}")
        for obj in vars(mod).values():
            if (isinstance(obj, type) and issubclass(obj, (MaximusOpBuilder, MaximusCUDAOpBuilder))
                    and obj not in (MaximusOpBuilder, MaximusCUDAOpBuilder) and obj.__module__ == mod.__name__):
                found.append(obj())
    return found


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _captured_lines(text: str) -> List[str]:
    """Printed lines without terminal colours (DeepSpeed's builders print a yellow `` [WARNING] ``)."""
    return [ln for ln in (_ANSI.sub("", raw).strip() for raw in text.splitlines()) if ln]


def _op_rows(build: bool) -> Tuple[List[tuple], List[str]]:
    """(op name, status, reason) per maximus op, and what the builders printed meanwhile (their warnings,
    which would otherwise land inside the table)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rows = _op_rows_quiet(build)
    return rows, list(dict.fromkeys(_captured_lines(printed.getvalue())))


def _op_rows_quiet(build: bool) -> List[tuple]:
    rows = []
    for b in builders():
        compatible = b.is_compatible(verbose=False)
        reason = "" if compatible else (b.error_log or "not compatible")
        status = "compatible" if compatible else "incompatible"
        from ds_maximus.op_builder.builder import extensions_dir
        if compatible and os.path.isdir(extensions_dir() / b.name):
            status += ", built (JIT cache)"
        if compatible and build:
            try:
                b.load()
                status = "compatible, built and loaded"
            except Exception as e:  # report, do not crash
                status, reason = "build failed", str(e).splitlines()[0]
        rows.append((b.name, status, reason))
    return rows


def o_direct_supported(path: str) -> tuple[bool, str]:
    """Try an aligned O_DIRECT write+read in ``path``."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this OS has no O_DIRECT"
    fd, name = tempfile.mkstemp(dir=path, prefix=".maximus_odirect_")
    os.close(fd)
    try:
        fd = os.open(name, os.O_RDWR | os.O_DIRECT)
    except OSError as e:
        os.unlink(name)
        return False, f"open(O_DIRECT) refused: {errno.errorcode.get(e.errno, e.errno)}"
    try:
        import mmap
        buf = mmap.mmap(-1, 4096)
        buf.write(b"x" * 4096)
        os.pwritev(fd, [buf], 0)
        os.preadv(fd, [buf], 0)
        return True, "ok"
    except OSError as e:
        return False, f"O_DIRECT I/O failed: {errno.errorcode.get(e.errno, e.errno)}"
    finally:
        os.close(fd)
        os.unlink(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds_maximus.env_report", description=__doc__.splitlines()[0])
    ap.add_argument("--nvme-path", default=None, help="folder of the NVMe tier to check")
    ap.add_argument("--build", action="store_true", help="also compile and load every compatible op")
    args = ap.parse_args(argv)

    import torch
    try:
        import deepspeed
        ds_version = deepspeed.__version__
    except Exception as e:  # report, do not crash
        ds_version = f"not importable ({e})"
    import ds_maximus
    print("ds_maximus environment report")
    print("-" * 60)
    print(f"ds_maximus ........ {ds_maximus.__version__}")
    print(f"python ............ {sys.version.split()[0]}")
    print(f"torch ............. {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    print(f"deepspeed ......... {ds_version}")
    print(f"CUDA available .... {torch.cuda.is_available()}"
          + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else ""))
    print(f"TORCH_CUDA_ARCH_LIST {os.environ.get('TORCH_CUDA_ARCH_LIST', '(unset)')}")
    from ds_maximus.op_builder.builder import DEFAULT_EXTENSIONS_DIR
    print(f"JIT cache ......... {os.environ.get('TORCH_EXTENSIONS_DIR', DEFAULT_EXTENSIONS_DIR)}")
    print("-" * 60)
    print(f"{'op':36s} {'status':30s} reason")
    rows, warnings = _op_rows(args.build)
    for name, status, reason in rows:
        print(f"{name:36s} {status:30s} {reason}")
    if warnings:
        print("-" * 60)
        print("warnings:")
        for line in warnings:
            print(f"  {line}")
    if args.nvme_path:
        print("-" * 60)
        p = args.nvme_path
        if not os.path.isdir(p):
            print(f"nvme path {p}: does not exist")
            return 1
        free = shutil.disk_usage(p).free
        ok, why = o_direct_supported(p)
        print(f"nvme path ......... {p}")
        print(f"free space ........ {free / 2**30:.1f} GiB")
        print(f"O_DIRECT .......... {'supported' if ok else 'not supported'} ({why})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
