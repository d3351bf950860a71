"""Builder of ``maximus_nvme_loader``: a C++ thread pool doing O_DIRECT pread/pwrite (no libaio)."""
from __future__ import annotations

import os
import sys

from .builder import MaximusOpBuilder


class NVMeLoaderBuilder(MaximusOpBuilder):
    """``NVMeLoaderBuilder().load()`` -> the op module (``Loader``, ``IOHandle``); JIT-compiled once."""

    NAME = "nvme_loader"

    def sources(self):
        return [self.csrc("nvme_loader", "common", "io_engine.cpp"),
                self.csrc("nvme_loader", "py_lib", "nvme_loader_py.cpp"),
                self.csrc("nvme_loader", "bindings.cpp")]

    def cxx_args(self):
        # no -march=native: the op is I/O bound and the JIT cache may be shared between hosts
        return ["-O2", "-g", "-Wno-reorder", "-std=c++17", "-pthread"]

    def extra_ldflags(self):
        return ["-pthread"]

    def is_compatible(self, verbose=False):
        if not sys.platform.startswith("linux") or not hasattr(os, "O_DIRECT"):
            self.warning(f"{self.name} needs Linux (pread/pwrite with O_DIRECT); this is {sys.platform}. "
                         "ShardStore falls back to plain file reads without it")
            return False
        return super().is_compatible(verbose)
