"""The quantized expert tier's format (ds_maximus.experts.quant): exact packing round trips, the per-group error
bound of every width, the layout checks; and the Triton in-GEMM dequantization against the reference (GPU)."""
import os

import pytest
import torch

from ds_maximus.experts.quant import (
    SUPPORTED_BITS,
    QuantizedTensor,
    check_layout,
    dequantize,
    pack,
    quantize,
    swiglu_reference,
    unpack,
)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("rows,cols", [(1, 8), (3, 24), (5, 136)])
def test_pack_unpack_round_trip_is_exact(bits, rows, cols):
    g = torch.Generator().manual_seed(bits * 100 + cols)
    codes = torch.randint(0, 1 << bits, (rows, cols), generator=g)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, cols * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_packing_puts_code_j_at_bit_j_times_bits(bits):
    """The documented layout: a row is one little-endian bit string, code c in bits [c*bits, (c+1)*bits)."""
    codes = torch.randint(0, 1 << bits, (2, 32), generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits)
    for r in range(2):
        stream = int.from_bytes(bytes(packed[r].tolist()), "little")
        assert [(stream >> (c * bits)) & ((1 << bits) - 1) for c in range(32)] == codes[r].tolist()


def test_known_packings():
    assert pack(torch.tensor([[1, 2] * 4]), 4).tolist() == [[0x21] * 4]
    assert pack(torch.tensor([[3, 0, 1, 2] * 2]), 2).tolist() == [[0b10010011] * 2]
    assert pack(torch.arange(8).reshape(1, 8), 8).tolist() == [list(range(8))]


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("group_size", [8, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_at_most_half_a_step(bits, group_size, dtype):
    g = torch.Generator().manual_seed(bits + group_size)
    w = (torch.randn(12, 256, generator=g) * 0.02).to(dtype)
    w[3, :64] += 0.5                                    # a group far from zero
    w[4, 64:128] = 0.125                                # a constant group
    w[5, :8] *= 1000                                    # outliers widen one group only
    q = quantize(w, bits, group_size)
    assert q.packed.shape == (12, 256 * bits // 8) and q.scales.shape == q.zeros.shape == (12, 256 // group_size)
    assert q.scales.dtype == q.zeros.dtype == torch.float16 and (q.scales > 0).all()
    err = (dequantize(q) - w.float()).abs()
    bound = q.scales.float().repeat_interleave(group_size, 1) / 2
    slack = 4 * torch.finfo(torch.float32).eps * w.float().abs().amax()   # fp32 rounding of codes*scale+zero
    assert (err <= bound + slack).all(), (err - bound).max()
    assert err[4, 64:128].max() == 0                    # 0.125 is an fp16 value: the constant group is exact
    # the offset is at or below the group minimum, and the step is the range from it over 2**bits - 1, rounded
    # up to fp16: the grid spans the group and is no coarser than it needs to be
    wf = w.float().reshape(12, -1, group_size)
    zeros = q.zeros.float()
    assert (zeros <= wf.amin(-1)).all()
    step = (wf.amax(-1) - zeros) / ((1 << bits) - 1)
    varying = step > 0
    assert (q.scales.float()[varying] >= step[varying]).all()
    assert torch.allclose(q.scales.float()[varying], step[varying], rtol=2 ** -10, atol=2 ** -24)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_quantize_is_idempotent_on_its_own_grid(bits):
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(7))
    q = quantize(w, bits, 32)
    q2 = quantize(dequantize(q), bits, 32)
    assert torch.equal(unpack(q2.packed, bits), unpack(q.packed, bits))


def test_error_shrinks_with_bits():
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(3))
    errs = [(dequantize(quantize(w, b, 64)) - w).norm() / w.norm() for b in (2, 3, 4, 8)]
    assert errs == sorted(errs, reverse=True) and errs[-1] < 0.01


def test_layout_errors_say_what_is_allowed():
    with pytest.raises(ValueError, match="bits=5"):
        check_layout((4, 64), 5, 64)
    with pytest.raises(ValueError, match="multiple of 8"):
        check_layout((4, 64), 4, 12)
    with pytest.raises(ValueError, match="divides 100"):
        quantize(torch.zeros(4, 100), 4, 64)
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.zeros(64), 4, 64)
    with pytest.raises(ValueError, match="inf or nan"):
        quantize(torch.full((1, 8), float("nan")), 4, 8)


def test_quantized_tensor_to_and_nbytes():
    q = quantize(torch.randn(16, 128), 4, 64)
    assert isinstance(q, QuantizedTensor) and q.nbytes == 16 * 64 + 2 * (16 * 2 * 2)
    q2 = q.to("cpu")
    assert torch.equal(q2.packed, q.packed) and q2.shape == q.shape and q2.bits == 4


def test_swiglu_reference_is_the_expert_formula():
    g = torch.Generator().manual_seed(0)
    x, w1, w3, w2 = (torch.randn(*s, generator=g) for s in ((3, 16), (24, 16), (24, 16), (16, 24)))
    want = (torch.nn.functional.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()
    assert torch.allclose(swiglu_reference(x, w1, w3, w2), want)
    q1, q3, q2 = (quantize(w, 8, 8) for w in (w1, w3, w2))
    deq = swiglu_reference(x, dequantize(q1), dequantize(q3), dequantize(q2))
    assert torch.equal(swiglu_reference(x, q1, q3, q2), deq)


def _triton_interpreter():
    """quant_triton under Triton's CPU interpreter, or a skip: triton missing, or TRITON_INTERPRET=1 not set
    before triton was imported (the interpreter runs only kernels made in that mode)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 to run the Triton kernels on CPU tensors in the interpreter")
    from ds_maximus.experts import quant_triton
    return quant_triton


_GEMV_CONFIG_IDS = [f"c{i}" for i in range(8)]


@pytest.mark.parametrize("config", range(8), ids=_GEMV_CONFIG_IDS)
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("tokens,rows,cols,group_size", [
    (1, 40, 512, 64),     # rows not a multiple of the row tile; split-K
    (3, 24, 768, 32),     # a token tile with a masked row; 24 groups: steps of 8 groups at most
    (8, 16, 256, 128),    # the largest token tile of the sizes tested: a row tile cut down to fit
    (17, 9, 128, 64),     # two token tiles (16 + 1); one group a step for 8 bits
])
def test_gemv_config_in_the_triton_interpreter_equals_reference(config, bits, tokens, rows, cols, group_size):
    """Each configuration the tuner may pick, on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1; skipped
    otherwise), against dequantize + fp32 matmul; ``sms=2`` makes the small grids split the columns."""
    qt = _triton_interpreter()
    assert len(qt.GEMV_CONFIGS) == len(_GEMV_CONFIG_IDS)
    cfg = qt.GEMV_CONFIGS[config]
    g = torch.Generator().manual_seed(bits * 1000 + rows)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(tokens, cols, generator=g).to(torch.bfloat16)
    q = quantize(w, bits, group_size)
    y = qt._launch_gemv(x, q, cfg, sms=2)
    want = x.float() @ dequantize(q).t()
    assert y.shape == (tokens, rows) and y.dtype == torch.float32
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert torch.equal(qt._launch_gemv(x, q, cfg, sms=2), y)      # the splits are added in a fixed order


def test_gemv_tuner_times_each_distinct_launch_once_and_keeps_the_fastest(monkeypatch):
    """The tuner (interpreter, timing faked): configurations that plan the same launch are timed once, the fastest
    is kept for the (rows, cols, token tile, bits, group) key, and a second call times nothing."""
    qt = _triton_interpreter()
    import triton.testing
    calls = []

    def fake_do_bench(fn, **kw):
        y = fn()                                              # the launch runs: the timed function is the product
        calls.append(y)
        return {0: 3.0, 1: 1.0}.get(len(calls) - 1, 2.0)      # the second distinct launch is the fastest
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(qt, "_TUNED", {})
    q = quantize(torch.randn(24, 256), 4, 64)
    x = torch.randn(1, 256)
    best = qt._tuned_config(x, q, sms=2)
    plans = {(c.plan(1, 24, 256, 4, 64, 2), c.num_warps, c.num_stages) for c in qt.GEMV_CONFIGS}
    assert len(calls) == len(plans) > 1
    firsts = []
    for c in qt.GEMV_CONFIGS:
        launch = (c.plan(1, 24, 256, 4, 64, 2), c.num_warps, c.num_stages)
        if launch not in [f[0] for f in firsts]:
            firsts.append((launch, c))
    assert best == firsts[1][1]
    want = x @ dequantize(q).t()
    for y in calls:
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert qt._tuned_config(torch.randn(1, 256), q, sms=2) == best and len(calls) == len(plans)


def test_gemv_plan_splits_columns_only_where_rows_leave_sms_idle():
    """The plan (no triton needed): a tall weight gets no split, a wide one (down projection) several, each
    split a whole number of steps, the token tile the next power of two, the row tile cut to fit the registers."""
    from ds_maximus.experts.quant_triton import GEMV_CONFIGS, GemvConfig
    cfg = GemvConfig(block_n=64, step_bytes=128, num_warps=4, num_stages=3, programs_per_sm=2)
    tall = cfg.plan(tokens=1, rows=28672, cols=4096, bits=4, group_size=64, sms=132)
    assert (tall.block_t, tall.block_n, tall.groups_per_step, tall.split) == (1, 64, 4, 1)
    wide = cfg.plan(tokens=1, rows=4096, cols=14336, bits=4, group_size=64, sms=132)
    assert wide.split > 1 and wide.k_per_split % (wide.groups_per_step * 64) == 0
    assert (wide.split - 1) * wide.k_per_split < 14336 <= wide.split * wide.k_per_split
    eight = cfg.plan(tokens=5, rows=28672, cols=4096, bits=8, group_size=64, sms=132)
    assert eight.block_t == 8 and eight.groups_per_step == 2 and eight.block_n * 8 * 128 <= 8192
    for c in GEMV_CONFIGS:
        for bits in (8, 4, 2):
            p = c.plan(tokens=3, rows=2048, cols=768, bits=bits, group_size=64, sms=132)
            assert p.block_n >= 8 and p.k_per_split % (p.groups_per_step * 64) == 0 and 12 % p.groups_per_step == 0
            assert (p.split - 1) * p.k_per_split < 768 <= p.split * p.k_per_split


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_gemv_configs_compile_for_hopper_without_a_gpu(bits):
    """Every configuration, at 1 and 8 tokens on the Mixtral gate_up shape, compiles for sm_90 through Triton's
    ahead-of-time path (its bundled ptxas; no GPU needed): what the interpreter cannot check."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter's kernels do not compile; run without TRITON_INTERPRET")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this triton has no ahead-of-time compile API")
    from ds_maximus.experts.quant_triton import GEMV_CONFIGS, _quant_gemv_kernel
    names = ["x_ptr", "packed_ptr", "scales_ptr", "zeros_ptr", "y_ptr", "T", "N", "K", "row_bytes", "groups",
             "k_per_split", "BITS", "GROUP", "BLOCK_T", "BLOCK_N", "GROUPS_PER_STEP"]
    kinds = ["*bf16", "*u8", "*fp16", "*fp16", "*fp32"] + ["i32"] * 6 + ["constexpr"] * 5
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 7, 8, 9, 10)}
    for tokens in (1, 8):
        for cfg in GEMV_CONFIGS:
            p = cfg.plan(tokens, 28672, 4096, bits, 64, 132)
            constexprs = {(11,): bits, (12,): 64, (13,): p.block_t, (14,): p.block_n, (15,): p.groups_per_step}
            src = ASTSource(_quant_gemv_kernel, dict(zip(names, kinds)), constexprs, aligned)
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
            assert k.asm["cubin"], (cfg, p)


@pytest.mark.gpu
@pytest.mark.parametrize("config", range(8), ids=_GEMV_CONFIG_IDS)
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize("rows,cols,group_size", [(2048, 768, 64), (4096, 14336, 64), (136, 320, 32)])
def test_triton_gemv_configs_equal_reference(config, bits, tokens, rows, cols, group_size):
    """Every configuration of the tuner's list on the GPU, Qwen3-MoE's and Mixtral's down shapes included."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    from ds_maximus.experts.quant_triton import GEMV_CONFIGS, quant_matmul
    g = torch.Generator().manual_seed(bits * 1000 + rows)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(tokens, cols, generator=g).to(torch.bfloat16).cuda()
    q = quantize(w, bits, group_size).to("cuda")
    y = quant_matmul(x, q, config=GEMV_CONFIGS[config])
    want = x.float() @ dequantize(q).t()
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("tokens", [1, 3, 16, 40])
@pytest.mark.parametrize("rows,cols,group_size", [(4096, 1024, 64), (136, 320, 64), (72, 256, 128), (40, 14336, 32)])
@pytest.mark.parametrize("block_n", [None, 32])
@pytest.mark.parametrize("kernel", ["loop", "gemv"])
def test_triton_dequant_matmul_equals_reference(bits, tokens, rows, cols, group_size, block_n, kernel):
    """Both kernels; the gemv kernel's split-K (the 40-row case: few rows, a long K) adds its splits in order."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    from ds_maximus.experts.quant_triton import _gemv_fits, quant_matmul
    g = torch.Generator().manual_seed(bits * 1000 + rows)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(tokens, cols, generator=g).to(torch.bfloat16).cuda()
    q = quantize(w, bits, group_size).to("cuda")
    if kernel == "gemv" and not _gemv_fits(q):
        with pytest.raises(ValueError, match="gemv kernel needs"):
            quant_matmul(x, q, kernel=kernel)
        return
    y = quant_matmul(x, q, block_n=block_n, kernel=kernel)
    want = x.float() @ dequantize(q).t()
    assert y.shape == (tokens, rows) and y.dtype == torch.float32
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_triton_expert_from_a_packed_slot_equals_reference(bits):
    """The path offload_experts takes: a Mixtral-shaped (scaled down) expert packed into one uint8 buffer, copied
    as bytes into the second slot of a CUDA slot table, each projection by quant.linear from views of the slot
    (storage offsets, fp16 views of uint8 memory), against the fp32 reference of the same packed weights."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    from ds_maximus.experts import quant
    from ds_maximus.experts.layout import ExpertLayout
    from ds_maximus.experts.quant_layout import QuantizedExpertLayout
    g = torch.Generator().manual_seed(bits)
    H, F = 512, 1792
    t = {"gate_up_proj": (torch.randn(1, 2 * F, H, generator=g) * 0.02).bfloat16(),
         "down_proj": (torch.randn(1, H, F, generator=g) * 0.02).bfloat16()}
    lay = QuantizedExpertLayout.from_layout(ExpertLayout.from_stacked(t, 1), bits, 64)
    host = lay.pack_(torch.empty(lay.numel, dtype=torch.uint8), {n: v[0] for n, v in t.items()})
    slots = torch.zeros(3, lay.numel, dtype=torch.uint8, device="cuda")
    slots[1].copy_(host)
    for tokens in (1, 5):
        x = torch.randn(tokens, H, generator=g).bfloat16().cuda()
        h = quant.linear(x, lay.view(slots[1], "gate_up_proj"))
        ref_h = x.float() @ dequantize(lay.view(host, "gate_up_proj")).cuda().t()
        torch.testing.assert_close(h, ref_h, rtol=1e-4, atol=1e-4 * ref_h.abs().max().item())
        a = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]).bfloat16()
        y = quant.linear(a, lay.view(slots[1], "down_proj"))
        ref_y = a.float() @ dequantize(lay.view(host, "down_proj")).cuda().t()
        torch.testing.assert_close(y, ref_y, rtol=1e-4, atol=1e-4 * ref_y.abs().max().item())


def test_bench_moe_quant_error_small_runs(capsys):
    """The error report's CPU size runs end to end: one row per width for ours and one for the hqq peer."""
    from benchmarks.bench_moe_quant_error import main
    assert main(["--small", "--tokens", "2"]) == 0
    out = capsys.readouterr().out
    for bits in SUPPORTED_BITS:
        assert f"| ours int{bits} |" in out and f"| hqq int{bits} |" in out
    assert "rel_err_text" in out
