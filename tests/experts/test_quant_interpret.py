"""The grouped dequant-GEMM kernels run by Triton's interpreter on the host (``TRITON_INTERPRET=1``), where triton is
installed but no GPU is: the kernel against the fp32 reference, and packed offload with it in place of the host
path against the per-expert loop. Skips without triton (as in CI); the same kernel on a GPU: ``test_quant.py``."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r'''
import torch
from ds_maximus.experts import compute, offload_experts, quant_triton as qt
from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.experts.quant import dequantize
from ds_maximus.experts.quant_layout import QuantizedExpertLayout
from tests.experts.test_quant_offload import per_expert_loop, prompt
from tests.experts.tiny_moe import tiny_model
qt._sm_count = lambda device: 4  # the interpreter has no device to ask; 4 makes the kernel split K
g = torch.Generator().manual_seed(0)
H, F, E = 128, 96, 5
for bits in (8, 4, 2):
    t = {"gate_up_proj": torch.randn(E, 2 * F, H, generator=g) * 0.02,
         "down_proj": torch.randn(E, H, F, generator=g) * 0.02}
    lay = QuantizedExpertLayout.from_layout(ExpertLayout.from_stacked(t, E), bits, 32)
    table = torch.zeros(4, lay.numel, dtype=torch.uint8)
    experts, slots = [3, 0, 4], [2, 0, 3]
    for e, s in zip(experts, slots):
        lay.pack_(table[s], {n: v[e] for n, v in t.items()})
    for counts in ([1, 1, 1], [3, 1, 20]):
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        meta = torch.tensor(starts + [s * lay.numel for s in slots], dtype=torch.long)
        # one row an expert: the token-tile kernel, then the one-row kernel at the default launches and with small
        # steps (several steps, split K)
        configs = [None, qt.DECODE_CONFIG, qt.decode_config(bits), qt.GemvConfig(16, 16, 4, 2, 8)]
        for name, cols in (("gate_up_proj", H), ("down_proj", F)):
            x = torch.randn(starts[-1], cols, generator=g)
            want = torch.cat([x[starts[i]:starts[i + 1]] @ dequantize(lay.view(table[s], name)).t()
                              for i, s in enumerate(slots)])
            for config in configs if max(counts) == 1 else [None]:
                y = qt.quant_matmul_grouped(x, table, lay.parts[name], lay.base.shapes[name], bits, 32, meta, 3,
                                            max(counts), config=config)
                assert ((y - want).abs().max() / want.abs().max()).item() < 1e-5, (bits, counts, name, config)
            if max(counts) > 1 and qt.mma_fits(bits, 32, torch.float16):
                # the tensor-core kernel, fp16 rows (the interpreter's own bf16 tl.dot is wrong; fp16 is exact here)
                x16 = x.half()
                want = torch.cat([x16[starts[i]:starts[i + 1]].float() @ dequantize(lay.view(table[s], name)).t()
                                  for i, s in enumerate(slots)])
                for mma in (qt.MMA_CONFIG, qt.MmaConfig(32, 16, 2, 4)):
                    y = qt.quant_matmul_grouped(x16, table, lay.parts[name], lay.base.shapes[name], bits, 32, meta,
                                                3, max(counts), mma=mma)
                    assert ((y - want).abs().max() / want.abs().max()).item() < 1e-5, (bits, counts, name, mma)

def grouped(ctx, x, name, slots, starts, meta, max_rows):  # the CUDA branch of _packed_linear, on host tensors
    lay = ctx.layout
    y = qt.quant_matmul_grouped(x, ctx.cache.slot_buffer(ctx.group), lay.parts[name], lay.base.shapes[name],
                                lay.bits, lay.group_size, meta, len(slots), max_rows,
                                config=qt.decode_config(lay.bits) if compute.DECODE_GEMV else None,
                                mma=compute.ROUND_MMA)
    return y.to(x.dtype)
compute._packed_linear = grouped
real, calls = compute.packed_forward, []
def checked(ctx, hidden, tki, tkw, used, pairs):
    out = real(ctx, hidden, tki, tkw, used, pairs)
    ref = per_expert_loop(ctx, hidden, tki, tkw, used, pairs)
    calls.append(len(used))
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=1e-2 * ref.float().abs().max().item())
    return out
compute.packed_forward = checked
ran = {"one_row": 0, "mma": 0}
def counting(key, fn):
    def counted(*args, **kwargs):
        ran[key] += 1
        return fn(*args, **kwargs)
    return counted
qt._gemv1_grouped = counting("one_row", qt._gemv1_grouped)
qt._mma_grouped = counting("mma", qt._mma_grouped)
# the token-tile kernel everywhere, then the one-row gemv for one-row rounds (the default), then (fp16 model, group
# 32: 16 columns a code plane) the tensor-core kernel for rounds of several rows
for kind, dtype, bits, group, gemv, mma in (("qwen3_moe", torch.bfloat16, 8, 16, False, None),
                                            ("qwen3_moe", torch.bfloat16, 4, 16, True, None),
                                            ("mixtral", torch.float16, 4, 32, True, qt.MMA_CONFIG)):
    compute.DECODE_GEMV, compute.ROUND_MMA = gemv, mma
    model = tiny_model(kind, "eager", top_k=2, dtype=dtype)
    h = offload_experts(model, {"gpu_experts_per_layer": 2, "quant": {"bits": bits, "group_size": group}})
    with torch.no_grad():
        for batch in (2, 1):
            model.generate(prompt(batch=batch, length=8), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                           pad_token_id=0)
    h.close()
assert calls and max(calls) > 2
assert ran["one_row"] and ran["mma"], ran  # both kernels served the rounds they are for
print("ok")
'''


def run_interpreted(script: str, timeout: int = 600) -> None:
    """Run ``script`` in a fresh process with ``TRITON_INTERPRET=1``; it must print ``ok`` last (skips without
    triton)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_grouped_kernel_under_the_triton_interpreter():
    run_interpreted(SCRIPT)
