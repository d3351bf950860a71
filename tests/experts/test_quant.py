"""The quantized expert tier's format (ds_maximus.experts.quant): exact packing round trips, the per-group error
bound of every width, the layout checks; and the Triton in-GEMM dequantization against the reference (GPU)."""
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


def _packed_round(bits, counts, H, F, group_size):
    """A round's experts packed into a slot table on the GPU, in reverse slot order with one slot left free:
    ``(generator, layout, slots, table, starts, meta)``; the generator goes on to draw the rows."""
    from ds_maximus.experts.layout import ExpertLayout
    from ds_maximus.experts.quant_layout import QuantizedExpertLayout
    g = torch.Generator().manual_seed(bits + len(counts))
    n = len(counts)
    t = {"gate_up_proj": (torch.randn(n, 2 * F, H, generator=g) * 0.02).bfloat16(),
         "down_proj": (torch.randn(n, H, F, generator=g) * 0.02).bfloat16()}
    lay = QuantizedExpertLayout.from_layout(ExpertLayout.from_stacked(t, n), bits, group_size)
    slots = list(range(n + 1))[::-1][:n]
    table = torch.zeros(n + 1, lay.numel, dtype=torch.uint8)
    for e, s in enumerate(slots):
        lay.pack_(table[s], {name: v[e] for name, v in t.items()})
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    meta = torch.tensor(starts + [s * lay.numel for s in slots], dtype=torch.long)
    return g, lay, slots, table.cuda(), starts, meta.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("counts", [[1, 1, 1, 1, 1, 1, 1, 1], [3, 1, 20], [40]])
@pytest.mark.parametrize("H,F,group_size", [(512, 192, 64), (2048, 768, 64), (256, 96, 32)])
def test_triton_grouped_equals_reference(bits, counts, H, F, group_size):
    """quant_matmul_grouped: a round's experts in one launch, each expert's rows (1 to 40: token tiles, split K)
    through the packed weight in its slot of a slot table, against the fp32 reference of each expert alone."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    from ds_maximus.experts.quant_triton import quant_matmul_grouped
    g, lay, slots, table, starts, meta = _packed_round(bits, counts, H, F, group_size)
    n = len(counts)
    for name, cols in (("gate_up_proj", H), ("down_proj", F)):
        x = torch.randn(starts[-1], cols, generator=g).bfloat16().cuda()
        y = quant_matmul_grouped(x, table, lay.parts[name], lay.base.shapes[name], bits, group_size, meta, n,
                                 max(counts))
        want = torch.cat([x[starts[i]:starts[i + 1]].float() @ dequantize(lay.view(table[s], name)).t()
                          for i, s in enumerate(slots)])
        assert y.shape == want.shape and y.dtype == torch.float32
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_triton_one_row_gemv_every_launch_equals_reference(bits):
    """The one-row kernel (every expert one row: batch-1 decode) under launches of the sweep's extremes (smallest
    and largest tiles and steps, split K wide), at a Mixtral-like down projection's long K, against the reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    from ds_maximus.experts import quant_triton as qt
    from ds_maximus.experts.layout import ExpertLayout
    from ds_maximus.experts.quant_layout import QuantizedExpertLayout
    g = torch.Generator().manual_seed(bits)
    H, F, n = 256, 1408, 2
    t = {"gate_up_proj": (torch.randn(n, 2 * F, H, generator=g) * 0.02).bfloat16(),
         "down_proj": (torch.randn(n, H, F, generator=g) * 0.02).bfloat16()}
    lay = QuantizedExpertLayout.from_layout(ExpertLayout.from_stacked(t, n), bits, 64)
    table = torch.zeros(n, lay.numel, dtype=torch.uint8)
    for e in range(n):
        lay.pack_(table[e], {name: v[e] for name, v in t.items()})
    table = table.cuda()
    meta = torch.tensor([0, 1, 2, lay.numel, 0], dtype=torch.long).cuda()  # expert 0 in slot 1, expert 1 in slot 0
    configs = [qt.DECODE_CONFIG, qt.GemvConfig(16, 32, 4, 1, 16), qt.GemvConfig(128, 256, 8, 4, 4)]
    for name, cols in (("gate_up_proj", H), ("down_proj", F)):
        x = torch.randn(n, cols, generator=g).bfloat16().cuda()
        want = torch.cat([x[i:i + 1].float() @ dequantize(lay.view(table[s], name)).t() for i, s in enumerate((1, 0))])
        for config in configs:
            y = qt.quant_matmul_grouped(x, table, lay.parts[name], lay.base.shapes[name], bits, 64, meta, n, 1,
                                        config=config)
            torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * want.abs().max().item(), msg=str(config))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("counts", [[2] * 8, [3, 1, 20], [130, 7], [1, 1, 2]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_mma_grouped_equals_reference(bits, counts, dtype):
    """The tensor-core kernel (rounds whose experts have several rows: token tiles of 16 to 64, an expert of a single
    row in a round with more, tiles past an expert's last row masked) against the fp32 reference of each expert."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    from ds_maximus.experts import quant_triton as qt
    n, H, F = len(counts), 512, 768
    g, lay, slots, table, starts, meta = _packed_round(bits, counts, H, F, 64)
    assert qt.mma_fits(bits, 64, dtype)
    for name, cols in (("gate_up_proj", H), ("down_proj", F)):
        x = torch.randn(starts[-1], cols, generator=g).to(dtype).cuda()
        want = torch.cat([x[starts[i]:starts[i + 1]].float() @ dequantize(lay.view(table[s], name)).t()
                          for i, s in enumerate(slots)])
        for mma in (qt.MMA_CONFIG, qt.MmaConfig(128, 16, 3, 8)):
            y = qt.quant_matmul_grouped(x, table, lay.parts[name], lay.base.shapes[name], bits, 64, meta, n,
                                        max(counts), mma=mma)
            assert y.shape == want.shape and y.dtype == torch.float32
            torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * want.abs().max().item(), msg=str(mma))


def test_bench_moe_quant_error_small_runs(capsys):
    """The error report's CPU size runs end to end: one row per width for ours and one for the hqq peer."""
    from benchmarks.bench_moe_quant_error import main
    assert main(["--small", "--tokens", "2"]) == 0
    out = capsys.readouterr().out
    for bits in SUPPORTED_BITS:
        assert f"| ours int{bits} |" in out and f"| hqq int{bits} |" in out
    assert "rel_err_text" in out


def test_bench_moe_quant_agreement_small_runs(tmp_path, capsys):
    """The trained-model agreement benchmark end to end at its smoke size: a tokenizer and a 2-layer Mixtral trained
    for a few steps in ``tmp_path``, then rows for the bf16 reference, fp32 and each width through offload_experts."""
    from benchmarks.bench_moe_quant_agreement import main
    assert main(["--small", "--steps", "4", "--bits", "8,4", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| bf16 model (the reference) | - | - | 1 | 1 | 0 |" in out
    for bits in (8, 4):
        assert f"| ours int{bits} (offload_experts, moe.quant) |" in out and f"| ours int{bits}, weights |" in out
    assert any(tmp_path.rglob("model.safetensors"))
