"""Large CPU tables for the expert tier: exact-size, written in parallel, then page-locked in place.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds every
request up to a power of two (the 11.3 GB master table of 2 Mixtral layers takes 16 GiB) and has the
driver fault in and lock every page from one thread before the data is written. For tables of tens
of GB that is both too much memory and most of the set-up time. :func:`host_tensor` instead maps
exactly the bytes asked for (private anonymous memory: zeros, no page touched yet, huge pages where the
kernel allows; not inherited by forked workers once pinned), lets the caller fill it
with ordinary multi-threaded torch copies (which fault the pages in parallel), and only then
registers it with ``cudaHostRegister``, so H2D/D2H copies from it are asynchronous DMA like from any
pinned tensor. The registration is undone when the last tensor viewing the memory is freed.

    >>> import torch
    >>> t = host_tensor((2, 3), torch.float32, init=lambda t: t.copy_(torch.ones(2, 3)))
    >>> t.shape, float(t.sum()), host_tensor((4,), torch.bfloat16).abs().sum().item()
    (torch.Size([2, 3]), 6.0, 0.0)
"""
from __future__ import annotations

import mmap
from typing import Callable, Optional, Sequence

import torch

from ds_maximus.errors import CapacityError

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context (as torch registers)


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
    after ``init`` when ``pin`` and CUDA is available (exact size, no power-of-two rounding)."""
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        if s < 0:
            raise ValueError(f"host_tensor shape {shape} has a negative size")
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # private anonymous memory: ordinary pages (transparent huge pages allowed), unlike mmap's default shared map
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_ANONYMOUS") else {}
    try:
        buf = _Mapping(-1, nbytes, **private)
    except (OSError, ValueError) as e:
        raise CapacityError(f"cannot map {nbytes / 2**30:.2f} GiB of CPU memory for a {tuple(shape)} {dtype} "
                            f"table ({e}); use the NVMe tier (moe.offload.device = 'nvme') or fewer experts") from e
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
            raise CapacityError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed (cudaError {int(rc)}): the "
                                "pinned CPU tier does not fit (ulimit -l, RAM); set moe.offload.pin_memory false "
                                "or use the NVMe tier")
        buf.registered_ptr = t.data_ptr()
    return t

