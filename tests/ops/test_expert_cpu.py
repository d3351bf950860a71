"""maximus_expert_cpu against the plain-PyTorch reference: bf16, fp32 and every quantized width, several token
counts, odd shapes; the decode of quantized rows is exact (same two roundings as the reference)."""
import pytest
import torch

from ds_maximus.experts.quant import SUPPORTED_BITS, dequantize, quantize, swiglu_reference
from ds_maximus.ops import expert_cpu
from tests.helpers.threads import torch_threads


def _expert(hidden, ffn, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w1, w3 = ((torch.randn(ffn, hidden, generator=g) / hidden ** 0.5).to(dtype) for _ in range(2))
    w2 = (torch.randn(hidden, ffn, generator=g) / ffn ** 0.5).to(dtype)
    return w1, w3, w2


def _close(y, want):
    # fp32 accumulation in a different order: a few ulps of the sum of |terms| per output
    torch.testing.assert_close(y, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 2, 7])
@pytest.mark.parametrize("hidden,ffn", [(64, 96), (33, 17), (128, 352)])
def test_swiglu_dense_equals_reference(dtype, tokens, hidden, ffn):
    w1, w3, w2 = _expert(hidden, ffn, dtype, seed=hidden + ffn)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
    y = expert_cpu.swiglu(x, w1, w3, w2)
    assert y.shape == (tokens, hidden) and y.dtype == torch.float32
    _close(y, swiglu_reference(x, w1, w3, w2))


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("hidden,ffn,group_size", [(64, 96, 32), (136, 200, 8), (256, 128, 128)])
def test_swiglu_quant_equals_reference(bits, tokens, hidden, ffn, group_size):
    w1, w3, w2 = _expert(hidden, ffn, torch.bfloat16, seed=bits * 7 + hidden)
    q1, q3, q2 = (quantize(w, bits, group_size) for w in (w1, w3, w2))
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens + bits))
    y = expert_cpu.swiglu(x, q1, q3, q2)
    _close(y, swiglu_reference(x, q1, q3, q2))


@pytest.mark.parametrize("bits", [None, *SUPPORTED_BITS])
@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("x_exact", [True, False], ids=["x-bf16-exact", "x-fp32"])
def test_bf16_dot_products_equal_reference(bits, tokens, x_exact):
    """The bf16 dot-product path (vdpbf16ps where the host has it): x exactly bf16 (one product a weight) and general
    fp32 x (split into bf16 hi + lo, two products); odd sizes (rows not a multiple of the row blocks, columns not of
    the 32-lane vector, groups of 40 codes: a full vector and a masked one); token counts across the token blocks."""
    hidden, ffn = (120, 200) if bits else (67, 45)
    w1, w3, w2 = _expert(hidden, ffn, torch.bfloat16, seed=11 + (bits or 0))
    if bits:
        w1, w3, w2 = (quantize(w, bits, 40) for w in (w1, w3, w2))
    x = 3 * torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    if x_exact:
        x = x.to(torch.bfloat16).float()
    _close(expert_cpu.swiglu(x, w1, w3, w2), swiglu_reference(x, w1, w3, w2))
    w = w1 if bits else w1.float()
    _close(expert_cpu.linear(x, w1), x @ (dequantize(w) if bits else w).t())


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_quantized_rows_decode_exactly(bits):
    """One token of a one-hot x reads one column of W: the op's decode equals the reference's bits (in calls of up
    to 3 tokens: from 4 the word decode takes 2^bits * sum(x) back once a row, within an ulp or two; see
    test_word_decode_from_four_tokens_is_within_two_ulps)."""
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(bits)).to(torch.bfloat16)
    q = quantize(w, bits, 16)
    eye, want = torch.eye(64), dequantize(q).t()
    for c0 in range(0, 64, 3):
        assert torch.equal(expert_cpu.linear(eye[c0:c0 + 3], q), want[c0:c0 + 3])
    assert torch.equal(expert_cpu.linear(eye, w), w.float().t())


# (bits, group size, columns): groups that tile a 64-byte block of codes (128 4-bit or 256 2-bit codes) and groups
# that span several blocks, each with a last block cut short by the row's end
WORD_SHAPES = [(4, 8, 136), (4, 64, 320), (4, 256, 768), (2, 16, 272), (2, 64, 320), (2, 512, 1536)]


@pytest.mark.parametrize("bits,group_size,cols", WORD_SHAPES)
def test_word_decode_reads_the_reference_bits(bits, group_size, cols):
    """The word decode (a code becomes bf16 2^bits + code, the 2^bits * sum(x) taken back lane by lane): a one-hot x
    of 1, 2 and 3 tokens reads each column of the dequantized weight bit for bit, as the byte lookup does."""
    if expert_cpu.kernel_isa() != "avx512_bf16":
        pytest.skip("the word decode is part of the AVX512-BF16 path")
    w = torch.randn(7, cols, generator=torch.Generator().manual_seed(cols)).to(torch.bfloat16)
    q = quantize(w, bits, group_size)
    want = dequantize(q).t()
    eye = torch.eye(cols)
    assert expert_cpu.quant_decode(bits, group_size) == "words"
    for tokens in (1, 2, 3):
        for c0 in range(0, cols - tokens + 1, 5):
            assert torch.equal(expert_cpu.linear(eye[c0:c0 + tokens], q), want[c0:c0 + tokens])


@pytest.mark.parametrize("bits,group_size,cols", WORD_SHAPES)
def test_word_decode_from_four_tokens_is_within_two_ulps(bits, group_size, cols):
    """From 4 tokens the word decode takes 2^bits * sum(x) back once a row and token, with the zero term: a one-hot
    x then reads round(scale * (2^bits + code)) + round(zero - 2^bits * scale), an ulp or two of 2^bits * scale
    from the reference's code * scale + zero."""
    w = torch.randn(7, cols, generator=torch.Generator().manual_seed(cols)).to(torch.bfloat16)
    q = quantize(w, bits, group_size)
    want = dequantize(q).t()
    got = expert_cpu.linear(torch.eye(cols), q)
    ulp = 2.0 ** (bits + 1 - 23) * q.scales.float().abs().max().item()  # an ulp of 2^(bits+1) * the largest scale
    torch.testing.assert_close(got, want, rtol=0, atol=2 * ulp)
    assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("bits,group_size,cols", WORD_SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("x_exact", [True, False], ids=["x-bf16-exact", "x-fp32"])
def test_word_decode_equals_reference(bits, group_size, cols, tokens, x_exact):
    """Random x through the word decode (its lane-by-lane form below 4 tokens, the folded one from 4) equals the
    reference."""
    g = torch.Generator().manual_seed(bits * tokens + cols)
    q = quantize(torch.randn(40, cols, generator=g).to(torch.bfloat16), bits, group_size)
    x = 3 * torch.randn(tokens, cols, generator=g)
    if x_exact:
        x = x.to(torch.bfloat16).float()
    _close(expert_cpu.linear(x, q), x @ dequantize(q).t())


def test_decode_choice():
    """Which decode the op takes: the word decode for 4- and 2-bit codes whose groups tile its blocks, the byte
    lookup elsewhere."""
    if expert_cpu.kernel_isa() != "avx512_bf16":
        assert expert_cpu.quant_decode(4, 64) == "fp32"
        return
    assert [expert_cpu.quant_decode(4, gs) for gs in (8, 64, 128, 256)] == ["words"] * 4
    assert [expert_cpu.quant_decode(2, gs) for gs in (16, 64, 256, 512)] == ["words"] * 4
    assert expert_cpu.quant_decode(4, 40) == "lookup"  # groups of 40 neither tile nor fill 128-code blocks
    assert expert_cpu.quant_decode(4, 192) == "lookup"
    assert expert_cpu.quant_decode(2, 8) == "lookup"  # a 2-bit lane holds 16 codes: groups of 8 split it
    assert expert_cpu.quant_decode(8, 64) == expert_cpu.quant_decode(3, 64) == "lookup"


@pytest.mark.parametrize("cols", [1, 15, 16, 17, 100])
def test_linear_odd_lengths(cols):
    g = torch.Generator().manual_seed(cols)
    w, x = torch.randn(5, cols, generator=g), torch.randn(3, cols, generator=g)
    _close(expert_cpu.linear(x, w), x @ w.t())


def test_bad_inputs_raise_clear_errors():
    w1, w3, w2 = _expert(16, 24, torch.bfloat16, 0)
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="expert shapes disagree"):
        expert_cpu.swiglu(x, w1, w3, w1)
    with pytest.raises(TypeError, match="share a dtype"):
        expert_cpu.swiglu(x, w1, w3.float(), w2)
    with pytest.raises(TypeError, match="three quantized"):
        expert_cpu.swiglu(x, quantize(w1, 4, 8), w3, w2)
    with pytest.raises(RuntimeError, match="features"):
        expert_cpu.swiglu(torch.randn(2, 8), w1, w3, w2)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        expert_cpu.linear(x, w1.half())


def test_bad_inputs_are_refused_before_the_op_runs(monkeypatch):
    """A C++ exception from the op aborted the process on a host whose compiler differs from torch's (the backtrace
    capture through the op's frames): argument errors are raised in Python, without calling into the op."""
    def no_op():
        raise AssertionError("the op was called with a bad argument")
    monkeypatch.setattr(expert_cpu, "load_op", no_op)
    w1, w3, w2 = _expert(16, 24, torch.bfloat16, 0)
    q1, q3, q2 = (quantize(w, 4, 8) for w in (w1, w3, w2))
    x = torch.randn(2, 16)
    for call, match in ((lambda: expert_cpu.swiglu(x, w1, w3, w1), "expert shapes disagree"),
                        (lambda: expert_cpu.swiglu(x, q1, q3, q1), "expert shapes disagree"),
                        (lambda: expert_cpu.swiglu(torch.randn(2, 8), w1, w3, w2), "features"),
                        (lambda: expert_cpu.swiglu(torch.randn(16), w1, w3, w2), "2-D"),
                        (lambda: expert_cpu.linear(x, w1.half()), "bfloat16 or float32"),
                        (lambda: expert_cpu.linear(torch.randn(2, 24), q1), "features"),
                        (lambda: expert_cpu.linear(x, w1[None]), "2-D CPU tensor")):
        with pytest.raises(RuntimeError, match=match):
            call()


@pytest.mark.parametrize("bits", [None, 4, 3])
def test_result_does_not_depend_on_the_thread_count(bits):
    """Each output is one row's fixed-order sum, whichever thread computes it (rows in blocks fixed by the shape)."""
    w1, w3, w2 = _expert(256, 320, torch.bfloat16, seed=5)
    if bits:
        w1, w3, w2 = (quantize(w, bits, 64) for w in (w1, w3, w2))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    with torch_threads(1):
        assert expert_cpu.max_threads() == 1  # the op shares torch's OpenMP runtime
        one = expert_cpu.swiglu(x, w1, w3, w2)
    with torch_threads(2):
        assert expert_cpu.max_threads() == 2
        two = expert_cpu.swiglu(x, w1, w3, w2)
        assert expert_cpu.load_op().dynamic_rows()  # the default: row blocks taken as threads come free
        expert_cpu.set_dynamic_rows(False)
        try:
            static = expert_cpu.swiglu(x, w1, w3, w2)
        finally:
            expert_cpu.set_dynamic_rows(True)
    assert torch.equal(one, two) and torch.equal(one, static)


def test_fp32_fallback_equals_reference():
    """MAXIMUS_EXPERT_CPU_FP32=1 runs the fp32 path (a host without AVX512-BF16) on any host: it matches too."""
    import os
    import subprocess
    import sys
    code = ("import torch\nfrom ds_maximus.experts.quant import quantize, swiglu_reference\n"
            "from ds_maximus.ops import expert_cpu\nassert expert_cpu.kernel_isa() == 'fp32'\n"
            "g = torch.Generator().manual_seed(0)\n"
            "w1, w3, w2 = torch.randn(40, 24, generator=g), torch.randn(40, 24, generator=g), "
            "torch.randn(24, 40, generator=g)\nx = torch.randn(3, 24, generator=g)\n"
            "ws3 = (w1, w3, w2)\n"
            "for ws in [ws3, [w.bfloat16() for w in ws3], [quantize(w, 4, 8) for w in ws3]]:\n"
            "    want = swiglu_reference(x, *ws)\n"
            "    tol = 2e-5 * want.abs().max().item()\n"
            "    torch.testing.assert_close(expert_cpu.swiglu(x, *ws), want, rtol=2e-5, atol=tol)\n"
            "print('ok')\n")
    env = dict(os.environ, MAXIMUS_EXPERT_CPU_FP32="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-2000:]


def test_kernel_isa_names_a_path():
    assert expert_cpu.kernel_isa() in ("avx512_bf16", "fp32")


def test_threads_are_openmp_threads():
    assert expert_cpu.max_threads() >= 1


def test_no_fallback_when_the_op_cannot_build(tmp_path):
    """Without a working compiler a call raises OpBuildError (what failed and the fix), never a slow fallback."""
    import os
    import subprocess
    import sys
    code = ("import torch\nfrom ds_maximus.errors import OpBuildError\nfrom ds_maximus.ops import expert_cpu\n"
            "try:\n    expert_cpu.swiglu(torch.ones(1, 8), *(torch.ones(8, 8),) * 3)\n"
            "except OpBuildError as e:\n    print('OpBuildError', e.op_name)\n")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), CXX=str(tmp_path / "no-such-compiler"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert "OpBuildError maximus_expert_cpu" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
