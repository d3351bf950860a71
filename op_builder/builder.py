"""Base classes of our op builders, on top of DeepSpeed's.

A builder is declarative (``NAME``, ``BUILD_VAR``, ``sources()``, ``include_paths()``,
``is_compatible()``); these bases add what an external extension needs from DeepSpeed 0.19.8:

* absolute source paths (DeepSpeed resolves relative ones against its own package),
* ``maximus_`` op names and ``DS_BUILD_MAXIMUS_<OP>`` build variables,
* a sanitised ``TORCH_CUDA_ARCH_LIST`` (``9.0a`` crashes DeepSpeed's parser),
* a JIT cache folder inside the checkout's ignored ``build/`` unless ``TORCH_EXTENSIONS_DIR`` is set, given to
  our builds only (the variable is set for the duration of our load and restored), so DeepSpeed's own ops
  (``fused_adam``, ``cpu_adam``) keep DeepSpeed's default cache and are not rebuilt into ours,
* one line on stderr when a build starts and one when it ends (with its seconds), only when a compile
  actually runs (not when the op loads from the JIT cache): a first run is not minutes of silence,
* :class:`ds_maximus.errors.OpBuildError` with the compiler log and the fix when a build fails,
* recovery from a stale JIT build lock: torch's ``FileBaton`` leaves ``<dir>/lock`` behind when a build
  is killed (Ctrl-C, a ``timeout``), and every later load then waits on it forever. Our loads write
  ``lock.owner`` (host and pid); a lock whose owner is gone, or an ownerless lock older than
  ``MAXIMUS_STALE_BUILD_LOCK_S`` (default 1200 s), is removed with a warning. (The first loader names
  itself; if it dies while a racing loader holds the lock, a third could take that lock for stale, and
  two builds then run at once: a narrow race, against a certain hang.)

Ops load once per process (DeepSpeed's ``_loaded_ops``) and are reused between processes
through torch's JIT cache.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder
from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

REPO_ROOT = Path(__file__).resolve().parent.parent
CSRC = REPO_ROOT / "csrc"
DEFAULT_EXTENSIONS_DIR = REPO_ROOT / "build" / "torch_extensions"
_ENV_LOCK = threading.RLock()  # one load at a time changes TORCH_EXTENSIONS_DIR


def extensions_dir() -> Path:
    """The JIT cache folder of our ops: ``$TORCH_EXTENSIONS_DIR`` when the user set it, else ``build/`` here."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or DEFAULT_EXTENSIONS_DIR)


@contextlib.contextmanager
def scoped_extensions_dir(path):
    """``TORCH_EXTENSIONS_DIR=path`` for the block only (torch's JIT reads the variable), restored after, so
    builds outside the block (DeepSpeed's own ops) keep their default folder."""
    with _ENV_LOCK:
        before = os.environ.get("TORCH_EXTENSIONS_DIR")
        os.environ["TORCH_EXTENSIONS_DIR"] = str(path)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("TORCH_EXTENSIONS_DIR", None)
            else:
                os.environ["TORCH_EXTENSIONS_DIR"] = before


def _library_mtime(build_dir: Path, name: str) -> Optional[float]:
    """Modification time of the newest built library of op ``name`` in ``build_dir`` (None: none built)."""
    times = [p.stat().st_mtime for p in build_dir.glob(f"{name}*.so")] if build_dir.is_dir() else []
    return max(times) if times else None


def build_needed(build_dir: Path, name: str) -> bool:
    """Whether loading op ``name`` from ``build_dir`` compiles: no library yet, or ninja (dry run over the
    last build file, which tracks sources and headers) has work to do."""
    if _library_mtime(build_dir, name) is None or not (build_dir / "build.ninja").is_file():
        return True
    ninja = shutil.which("ninja")
    if ninja is None:
        return False  # torch's own check reports the missing ninja
    try:
        out = subprocess.run([ninja, "-n", "-C", str(build_dir)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode != 0 or "no work to do" not in out.stdout


def _say(text: str) -> None:
    print(f"ds_maximus: {text}", file=sys.stderr, flush=True)


def sanitize_cuda_arch_list(value: str | None) -> str | None:
    """Drop arch-specific suffixes DeepSpeed cannot parse: ``"9.0a;8.0"`` -> ``"9.0;8.0"``.

    >>> sanitize_cuda_arch_list("9.0a 10.0f+PTX")
    '9.0;10.0+PTX'
    """
    if value is None:
        return None
    out = []
    for cc in re.split(r"[;\s]+", value.strip()):
        if not cc:
            continue
        m = re.fullmatch(r"(\d+)\.(\d+)[a-zA-Z]*(\+PTX)?", cc)
        if m is None:
            continue  # names such as "Hopper" are not understood by DeepSpeed's builder either
        out.append(f"{m.group(1)}.{m.group(2)}{m.group(3) or ''}")
    return ";".join(dict.fromkeys(out)) or None


def _owner_pid(owner: Path) -> Optional[int]:
    """The pid in ``lock.owner`` when it was written on this host, else None."""
    try:
        host, pid = owner.read_text().split()
        return int(pid) if host == socket.gethostname() else None
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clear_stale_build_locks(ext_dir, name: str, max_age_s: Optional[float] = None) -> List[Path]:
    """Remove JIT build locks of op ``name`` (folders ``name*`` under ``ext_dir``) that no build holds;
    returns the locks removed. A lock is stale when the process named in its ``lock.owner`` is gone, or,
    without an owner on this host, when it is older than ``max_age_s``."""
    if max_age_s is None:
        max_age_s = float(os.environ.get("MAXIMUS_STALE_BUILD_LOCK_S", 1200))
    removed = []
    root = Path(ext_dir)
    if not root.is_dir():
        return removed
    for d in root.glob(f"{name}*"):
        lock, owner = d / "lock", d / "lock.owner"
        pid = _owner_pid(owner)
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:
            if pid is not None and not _alive(pid):   # an owner note left without a lock: drop it
                with contextlib.suppress(OSError):
                    owner.unlink()
            continue
        if pid is not None:
            why = f"its build (pid {pid}) is gone" if not _alive(pid) else None
        else:
            why = f"it is {age:.0f} s old and names no live build" if age > max_age_s else None
        if why is None:
            continue
        with contextlib.suppress(OSError):
            lock.unlink()
            removed.append(lock)
        with contextlib.suppress(OSError):
            owner.unlink()
        logging.getLogger("ds_maximus").warning("removed the stale JIT build lock %s (%s; a killed build leaves "
                                                "it, and every later load would wait on it forever)", lock, why)
    return removed


class _MaximusBuilderMixin:
    """Shared behaviour of the CPU and CUDA bases. Subclasses set ``NAME`` (without prefix)."""

    NAME = ""
    BUILD_VAR = ""
    BUILD_ESTIMATE_MIN = 1  # minutes a first build takes (said when it starts)

    def __init__(self):
        if not self.NAME:
            raise TypeError(f"{type(self).__name__} must set NAME")
        self.BUILD_VAR = self.BUILD_VAR or f"DS_BUILD_MAXIMUS_{self.NAME.upper()}"
        super().__init__(name=f"maximus_{self.NAME}")

    def absolute_name(self):
        return f"ds_maximus.ops.{self.name}_op"

    @staticmethod
    def csrc(*parts: str) -> str:
        """Absolute path of a file under ``csrc/``."""
        return str(CSRC.joinpath(*parts))

    def include_paths(self):
        return [str(CSRC)]

    def is_compatible(self, verbose=False):
        return super().is_compatible(verbose)

    def load(self, verbose=False):
        if self.name in OpBuilder._loaded_ops:  # loaded once per process
            return OpBuilder._loaded_ops[self.name]
        ext_dir = extensions_dir()
        with scoped_extensions_dir(ext_dir):
            return self._load(ext_dir, verbose)

    def _load(self, ext_dir: Path, verbose=False):
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        fixed = sanitize_cuda_arch_list(arch)
        if arch is not None and fixed != arch:
            if fixed:
                os.environ["TORCH_CUDA_ARCH_LIST"] = fixed
            else:
                os.environ.pop("TORCH_CUDA_ARCH_LIST")
        if not self.is_compatible(verbose):
            from ds_maximus.errors import OpBuildError
            raise OpBuildError(self.name, "not compatible with this machine", fix=self.error_log or "")
        clear_stale_build_locks(ext_dir, self.name)
        owner = Path(ext_dir) / self.name / "lock.owner"
        mine = None
        with contextlib.suppress(OSError):
            if not (owner.parent / "lock").exists():
                owner.parent.mkdir(parents=True, exist_ok=True)
                note = f"{socket.gethostname()} {os.getpid()}"
                with open(owner, "x") as f:      # the first loader names itself; a racing one does not
                    f.write(note)
                mine = note
        log = io.StringIO()
        build_dir = Path(ext_dir) / self.name
        before = _library_mtime(build_dir, self.name)
        announced = build_needed(build_dir, self.name)
        if announced:
            _say(f"building {self.name} (first run only, ~{self.BUILD_ESTIMATE_MIN} min) in {build_dir}")
        t0 = time.perf_counter()
        try:
            # torch prints the compiler output on failure; keep it for the error as well
            with contextlib.redirect_stdout(_Tee(sys.stdout, log)):
                op = super().load(verbose=verbose)
            if announced or _library_mtime(build_dir, self.name) != before:
                _say(f"built {self.name} in {time.perf_counter() - t0:.1f} s")
            return op
        except Exception as e:  # compiler or linker failure, missing ninja, ...
            from ds_maximus.errors import OpBuildError
            text = f"{log.getvalue()}\n{e}"
            raise OpBuildError(self.name, type(e).__name__ + ": " + str(e).splitlines()[0] if str(e) else "",
                               log=text, fix=_fix_for(text)) from e
        finally:
            with contextlib.suppress(OSError):
                if mine is not None and owner.read_text() == mine:
                    owner.unlink()


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self):
        for st in self.streams:
            st.flush()


def _fix_for(log: str) -> str:
    if "ninja" in log.lower() and "not" in log.lower():
        return "pip install ninja"
    if "Python.h" in log:
        return "install the Python development headers (apt-get install python3-dev)"
    if "nvcc" in log and ("not found" in log or "No such file" in log):
        return "install the CUDA toolkit matching torch.version.cuda, or set CUDA_HOME"
    if "invalid literal for int()" in log:
        return "set TORCH_CUDA_ARCH_LIST to plain numbers, e.g. 9.0"
    return (f"read the compiler log above; remove {extensions_dir()} "
            "to force a clean rebuild")


class MaximusOpBuilder(_MaximusBuilderMixin, CPUOpBuilder):
    """CPU (C++/OpenMP) op builder on DeepSpeed's ``CPUOpBuilder``."""

    def cxx_args(self):
        args = super().cxx_args()
        # -fno-math-errno: sqrtf may then be vectorised (errno is never read; with it the optimizer loops ran
        # scalar, at ~1/7 of DeepSpeed's CPU Adam)
        return [a for a in args if a] + ["-std=c++17", "-fno-math-errno"]


class MaximusCUDAOpBuilder(_MaximusBuilderMixin, CUDAOpBuilder):
    """CUDA op builder on DeepSpeed's ``CUDAOpBuilder``."""

    BUILD_ESTIMATE_MIN = 3

    def is_compatible(self, verbose=False):
        import torch
        if torch.version.cuda is None:
            self.warning(f"{self.name} needs a CUDA build of torch (this torch is {torch.__version__}); "
                         "use the CPU twin of this op, or install a CUDA torch")
            return False
        return super().is_compatible(verbose)

    def nvcc_args(self):
        return super().nvcc_args() + ["-lineinfo"]
