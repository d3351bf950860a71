import time, torch
from ds_maximus.partition.staged_update import HostGate
g = HostGate("cuda", max_hold_s=5.0)
print("supported", g.supported, "addr", hex(g._addr or 0), "ptr", hex(g._word.data_ptr()))
s = torch.cuda.Stream()
src = torch.randn(1 << 20, device="cuda"); dst = torch.empty(1 << 20, pin_memory=True); torch.cuda.synchronize()
t0 = time.perf_counter()
print("hold", g.hold(s))
with torch.cuda.stream(s):
    dst.copy_(src, non_blocking=True); e = torch.cuda.Event(); e.record(s)
print("queued", time.perf_counter() - t0)
time.sleep(0.2); print("query after 0.2 s", e.query(), time.perf_counter() - t0)
g.open(); e.synchronize(); print("done after open", time.perf_counter() - t0)
