"""Probe: what pinned host allocations and the host-sum op cost on this machine (host accumulation's suspects).

    python scripts/gpu/probe_pinned.py
"""
import threading
import time

import torch

from ds_maximus.ops.row_ops import grad_sum
from ds_maximus.partition.host_memory import host_tensor

N = 3 * 4096 * 1792  # a fine-grained expert's parameters


def t(fn, n=5):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return " ".join(f"{x:.1f}" for x in out)


keep = []
print("fresh pinned bf16 (44 MB, kept):", t(lambda: keep.append(torch.empty(N, dtype=torch.bfloat16, pin_memory=True))))
print("fresh pinned fp32 (88 MB, kept):", t(lambda: keep.append(torch.empty(N, dtype=torch.float32, pin_memory=True))))
keep.clear()
print("pinned bf16 after free (cached):", t(lambda: torch.empty(N, dtype=torch.bfloat16, pin_memory=True)))
print("host_tensor fp32 pin (88 MB):", t(lambda: keep.append(host_tensor((N,), torch.float32, pin=True))))
dev = torch.device("cuda")
g = torch.randn(N, device=dev).bfloat16()
dst = torch.empty(N, dtype=torch.bfloat16, pin_memory=True)


def d2h():
    dst.copy_(g, non_blocking=True)
    torch.cuda.synchronize()


print("D2H 44 MB into pinned:", t(d2h))
base = torch.randn(N, pin_memory=True)
add = torch.randn(N).bfloat16().pin_memory()
print("threads", torch.get_num_threads())
print("grad_sum fp32+bf16 main thread:", t(lambda: grad_sum(base, base, 0.5, add)))
pb, pa = torch.randn(N), torch.randn(N).bfloat16()
print("grad_sum on unpinned memory:", t(lambda: grad_sum(pb, pb, 0.5, pa)))
hb = host_tensor((N,), torch.float32, pin=True, init=lambda x: x.copy_(pb))
ha = host_tensor((N,), torch.bfloat16, pin=True, init=lambda x: x.copy_(pa))
print("grad_sum on host_tensor (registered) memory:", t(lambda: grad_sum(hb, hb, 0.5, ha)))
print("torch mul_ on torch-pinned fp32:", t(lambda: base.mul_(1.0001)), "| on unpinned:", t(lambda: pb.mul_(1.0001)))
res = []
th = threading.Thread(target=lambda: res.append(t(lambda: grad_sum(base, base, 0.5, add))))
th.start()
th.join()
print("grad_sum in a worker thread:", res[0])
# two threads at once, both using the intra-op pool (the CPU step's team beside the worker's)
big = torch.randn(8 * N)
res2 = []
th = threading.Thread(target=lambda: res2.append(t(lambda: grad_sum(base, base, 0.5, add), 10)))
th.start()
print("torch add on main while the worker sums:", t(lambda: big.mul_(1.0001), 10))
th.join()
print("grad_sum in worker with main busy:", res2[0])
