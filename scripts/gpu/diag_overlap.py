"""Diagnostic: the overlapped and the synchronous split step on the same tiny Mixtral; prints which experts each
side stepped in each run and which rows of the final masters and moments differ (none expected: the CPU and CUDA
ops give the same bits). On the GPU machine, after ``. .device/env.sh``:
``python scripts/gpu/diag_overlap.py`` (runs on the CPU too)."""
import torch

from ds_maximus.experts.training.step import InPlaceStep, SplitStep
from tests.experts.training.moe_utils import batches, build, moe_section, tiny_mixtral
from tests.helpers.models import train

real_share = SplitStep.cpu_share
real_inplace = InPlaceStep.update


def run(overlap, data):
    sides, factors = [], []

    def share(step, uids, s):
        cpu = real_share(step, uids, s)
        grads = step.parts.grads
        sides.append((sorted(uids), cpu, [u for u in uids if grads.on_host(u)],
                      {u: (str(grads.raw(u).dtype)[6:], grads.factor(u)) for u in uids}))
        return cpu

    def inplace(step, uid, grad, grad_scale=1.0):
        factors.append((uid, str(grad.dtype)[6:], grad_scale))
        real_inplace(step, uid, grad, grad_scale)
    SplitStep.cpu_share, InPlaceStep.update = share, inplace
    try:
        model = tiny_mixtral(num_experts=8)
        e = build(model.cuda() if torch.cuda.is_available() else model, 2, dtype="bf16", clip=0.05,
                  maximus=moe_section(slots=2, gpu_grad_experts=1, optimizer_device="split", cpu_step_share=0.5,
                                      step_chunk_bytes=1 << 16, overlap_step=overlap))
        losses = train(e, data)
        t = e.maximus.modules["moe"]
        t.finish_step()
    finally:
        SplitStep.cpu_share, InPlaceStep.update = real_share, real_inplace
    return t, losses, sides, factors


data = batches(6, batch=2, seqlen=8)
ts, ls, ss, fs = run(False, data)
to, lo, so, fo = run(True, data)
print("losses equal:", ls == lo)
for k, (a, b) in enumerate(zip(ss, so)):
    print(f"step {k + 1}: sync cpu={a[1]} overlap cpu={b[1]} | host grads sync={a[2]} overlap={b[2]}")
    print(f"   grads sync={a[3]}\n   grads ovl ={b[3]}")
for n in ts.store.tables:
    d = (ts.store.tables[n] != to.store.tables[n]).any(dim=1).nonzero().flatten().tolist()
    print(n, "rows differing:", d)
print("cpu side calls sync:", fs[-12:])
print("cpu side calls ovl :", fo[-12:])
