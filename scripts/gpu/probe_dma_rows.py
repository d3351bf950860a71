"""Probe: moving a step's missed embedding rows by copy-engine DMA (``cudaMemcpyBatchAsync``, one 16 KiB copy a
row and table) against the cache's ``copy_rows`` kernels (8 blocks), one direction and both at once.

    python scripts/gpu/probe_dma_rows.py [--rows 1741] [--dim 4096]
"""
import argparse
import ctypes
import statistics

import torch

from ds_maximus.ops.row_ops import load_op
from ds_maximus.partition.host_memory import host_tensor


class MemLoc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttrs(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", MemLoc), ("dstLocHint", MemLoc),
                ("flags", ctypes.c_uint)]


def cudart():
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = sorted({ln.split()[-1] for ln in f if "libcudart.so" in ln})
    lib = ctypes.CDLL(paths[0])
    fn = lib.cudaMemcpyBatchAsync
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    ver = ctypes.c_int()
    lib.cudaRuntimeGetVersion(ctypes.byref(ver))
    print("cudart", paths[0], ver.value)
    return fn


def batch_args(dst_tabs, dst_rows, src_tabs, src_rows, row_bytes):
    n = len(dst_rows) * len(dst_tabs)
    dsts, srcs = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
    sizes = (ctypes.c_size_t * n)(*([row_bytes] * n))
    k = 0
    for dt, st in zip(dst_tabs, src_tabs):
        db, sb = dt.data_ptr(), st.data_ptr()
        for dr, sr in zip(dst_rows, src_rows):
            dsts[k], srcs[k] = db + dr * row_bytes, sb + sr * row_bytes
            k += 1
    attrs = MemcpyAttrs(1, MemLoc(0, 0), MemLoc(0, 0), 0)  # stream order, no hints
    idx = (ctypes.c_size_t * 1)(0)
    return dsts, srcs, sizes, n, attrs, idx


def timed(fn, streams, n=10):
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for st in streams:
            st.wait_event(s)
        fn()
        for st in streams:
            torch.cuda.current_stream().wait_stream(st)
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1741)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--table-rows", type=int, default=262144)
    a = p.parse_args()
    dev = torch.device("cuda")
    fn = cudart()
    op = load_op("cuda")
    tier = [host_tensor((a.table_rows, a.dim), torch.float32, pin=True) for _ in range(3)]
    slots = [torch.zeros(26214, a.dim, device=dev) for _ in range(3)]
    stage = [torch.zeros(a.rows, a.dim, device=dev) for _ in range(3)]
    g = torch.Generator().manual_seed(0)
    ids_in = torch.randperm(a.table_rows, generator=g)[:a.rows]
    ids_out = torch.randperm(a.table_rows, generator=g)[:a.rows]
    sl = torch.randperm(26214, generator=g)[:a.rows]
    rb = a.dim * 4
    mib = 3 * a.rows * rb / 2**20
    h2d_s, d2h_s = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=-1)
    d_ids_in, d_sl, d_ids_out = ids_in.to(dev), sl.to(dev), ids_out.to(dev)
    iota = torch.arange(a.rows, device=dev)

    def k_h2d():
        with torch.cuda.stream(h2d_s):
            for t, s in zip(tier, slots):
                op.copy_rows(t, d_ids_in, s, d_sl, 8)

    def k_d2h():
        with torch.cuda.stream(d2h_s):
            for s, t in zip(stage, tier):
                op.copy_rows(s, iota, t, d_ids_out, 8)

    h2d_args = batch_args(slots, sl.tolist(), tier, ids_in.tolist(), rb)
    d2h_args = batch_args(tier, ids_out.tolist(), stage, list(range(a.rows)), rb)

    def dma(args, stream):
        dsts, srcs, sizes, n, attrs, idx = args
        rc = fn(dsts, srcs, sizes, n, ctypes.byref(attrs), idx, 1, ctypes.c_void_p(stream.cuda_stream))
        assert rc == 0, f"cudaMemcpyBatchAsync returned {rc}"

    def b_h2d():
        dma(h2d_args, h2d_s)

    def b_d2h():
        dma(d2h_args, d2h_s)

    # correctness of both paths: a row's bytes arrive where they should
    for t in tier:
        t[ids_in[:4]] = torch.randn(4, a.dim)
    b_h2d()
    torch.cuda.synchronize()
    assert all(torch.equal(s[d_sl[:4]].cpu(), t[ids_in[:4]]) for s, t in zip(slots, tier))
    rows = []
    for name, f, sts in [("copy_rows H2D", k_h2d, [h2d_s]), ("copy_rows D2H", k_d2h, [d2h_s]),
                         ("copy_rows both", lambda: (k_h2d(), k_d2h()), [h2d_s, d2h_s]),
                         ("DMA batch H2D", b_h2d, [h2d_s]), ("DMA batch D2H", b_d2h, [d2h_s]),
                         ("DMA batch both", lambda: (b_h2d(), b_d2h()), [h2d_s, d2h_s]),
                         ("DMA H2D + copy_rows D2H", lambda: (b_h2d(), k_d2h()), [h2d_s, d2h_s])]:
        ms = timed(f, sts)
        both = 2 if "both" in name or "+" in name else 1
        rows.append(f"| {name} | {ms:.3f} | {both * mib / 1024 / (ms / 1e3):.1f} |")
    import time
    t0 = time.perf_counter()
    for _ in range(20):
        batch_args(slots, sl.tolist(), tier, ids_in.tolist(), rb)
    print(f"host ms to build one batch's pointer arrays (ctypes): {(time.perf_counter() - t0) / 20 * 1e3:.2f}")
    print(f"{a.rows} rows x 3 tables x {rb} B = {mib:.1f} MiB a direction")
    print("| path | ms | GiB/s (both directions summed) |\n|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
