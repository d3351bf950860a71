"""The real-scale options of ``benchmarks/bench_moe_offload.py`` at CPU size: the Qwen3-MoE family, experts
regenerated on the compute device for every offloaded peer (``--expert-source gpu``), slots per layer from a cap
(``--slots auto``), the agreement length apart from the decode length (``--agree-tokens``), and the rows and
columns they add."""
import argparse

import pytest
import torch

from benchmarks.bench_moe_offload import (
    GIB,
    ExpertSource,
    Reference,
    auto_slots,
    build,
    gpu_busy,
    main,
    parse_peers,
    resolve_shape,
    union_length,
)
from ds_maximus.experts import offload_experts
from ds_maximus.experts.adapters import find_moe_blocks
from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.experts.quant_layout import QuantizedExpertLayout

BIG = "1e9"  # the harness budget counts from its import: in-process runs get one that no suite outlasts


def small_args(family: str) -> argparse.Namespace:
    args = argparse.Namespace(family=family, small=True, layers=None, hidden=None, ffn=None, experts=None,
                              top_k=None, vocab=None, tokens=None, baseline_tokens=None, agree_tokens=None)
    resolve_shape(args)
    args.dtype = torch.float32
    return args


def table(out: str) -> dict:
    """``{provider: {column: cell}}`` of the markdown table printed by the benchmark (the header row under
    ``"provider"``)."""
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in rows[0].split("|")]
    return {cells[1]: dict(zip(header, cells)) for cells in ([c.strip() for c in r.split("|")] for r in rows)}


def test_auto_slots_arithmetic():
    mb = 1 << 20
    # (cap - resident - reserve) // (layers * expert bytes), here (1000 - 200 - 100) MiB // (4 * 50 MiB) = 3
    assert auto_slots(1000 * mb, 200 * mb, 4, 50 * mb, 8, reserve_bytes=100 * mb) == 3
    assert auto_slots(1000 * mb, 200 * mb, 4, 50 * mb, 2, reserve_bytes=100 * mb) == 2   # at most every expert
    assert auto_slots(1000 * mb, 990 * mb, 4, 50 * mb, 8, reserve_bytes=100 * mb) == 1   # at least one
    # default reserve: 1.5 GiB + 10% of the cap
    assert auto_slots(10 * GIB, 0, 1, GIB, 16) == int((10 - 1.5 - 1.0) // 1)
    # the real Mixtral-8x7B under 16 GiB (~3.2 GB of attention, embeddings and head on the GPU): the bf16 expert
    # (352 MB) gets one slot a layer, its 4-bit form (group 64) three, the 2-bit form six
    ex = ExpertLayout.from_stacked({"gate_up_proj": torch.empty(8, 28672, 4096, dtype=torch.bfloat16, device="meta"),
                                    "down_proj": torch.empty(8, 4096, 14336, dtype=torch.bfloat16, device="meta")}, 8)
    got = [auto_slots(16 * GIB, 3.2e9, 32, lay.nbytes, 8)
           for lay in (ex, *(QuantizedExpertLayout.from_layout(ex, b, 64) for b in (4, 2)))]
    assert got == [1, 3, 6]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("family", ["mixtral", "qwen3"])
def test_regenerated_experts_equal_the_build(family, device):
    """``--expert-source gpu``: after an offload took the experts, the next peer's regeneration on the compute
    device gives the build's weights bit for bit, back in the model's own experts modules, and the model's
    logits are the build's again."""
    device = torch.device(device)
    args = small_args(family)
    if device.type == "cuda":
        args.dtype = torch.bfloat16
    model = build(args, device)
    blocks = find_moe_blocks(model)
    assert len(blocks) == args.layers and blocks[0].num_experts == args.experts
    first = [{n: t.detach().clone() for n, t in b.expert_tensors().items()} for b in blocks]
    assert not torch.equal(first[0]["down_proj"], first[1]["down_proj"])  # each layer its own generator
    ids = torch.randint(1, args.vocab, (1, 12), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        logits = model(ids).logits
    src = ExpertSource("gpu", blocks, device, model.bench_expert_stds)
    assert src.snap is None and all(not hasattr(b.experts, "down_proj") for b in blocks)  # no copy kept
    for _ in range(2):  # a peer's regeneration and offload, then the next one's
        src.restore()
        for b, tensors in zip(blocks, first):
            assert b.block.experts is b.experts
            for n, t in tensors.items():
                assert torch.equal(b.expert_tensors()[n], t), n
        handle = offload_experts(model, {"gpu_experts_per_layer": 2})
        assert all(not hasattr(b.experts, "down_proj") for b in blocks)  # the offload took the model's copies
        del handle
    src.restore()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_host_regen_source_builds_the_same_weights_with_the_experts_on_the_host(device):
    """``--expert-source host-regen``: the build keeps the experts in host memory (drawn on the device a layer at a
    time: the device build's numbers), everything else on the device; each peer regenerates them there."""
    device = torch.device(device)
    args = small_args("mixtral")
    if device.type == "cuda":
        args.dtype = torch.bfloat16
    want = dict(build(args, device).named_parameters())
    model = build(args, device, host_experts=True)
    blocks = find_moe_blocks(model)
    experts = {id(t) for b in blocks for t in b.expert_tensors().values()}
    for name, p in model.named_parameters():
        assert p.device.type == ("cpu" if id(p) in experts else device.type), name
        assert torch.equal(p.detach().cpu(), want[name].detach().cpu()), name
    ids = torch.randint(1, args.vocab, (1, 12), generator=torch.Generator().manual_seed(3)).to(device)
    src = ExpertSource("host-regen", blocks, device, model.bench_expert_stds)
    src.restore()
    for b in blocks:
        for n, t in b.expert_tensors().items():
            assert t.device.type == "cpu" and torch.equal(t, want[f"{b.name}.experts.{n}"].cpu()), n
    handle = offload_experts(model, {"gpu_experts_per_layer": 2})
    with torch.no_grad():
        assert model(ids).logits.shape[-1] == args.vocab
    handle.close()


def test_reference_length_is_agree_tokens():
    """The quality reference is the bf16 model's continuation of ``--agree-tokens``, whatever the decode length."""
    args = small_args("mixtral")
    model = build(args, torch.device("cpu"))
    ids = torch.randint(1, args.vocab, (1, 8), generator=torch.Generator().manual_seed(1))
    ref = Reference(model, ids, 20)
    assert ref.seq.shape == (1, 28) and ref.logits.shape[:2] == (1, 20)
    assert ref.compare(model) == {"token agree": 1.0, "rel err": 0.0}


def test_peer_order():
    ns = argparse.Namespace(quick=False, peers="whole,int4,cpu,int4+cpu,full,ours,int4")
    assert parse_peers(ns) == ["full", "int4", "int4+cpu", "ours", "cpu", "whole"]


def _resident_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." not in n)


@pytest.mark.skipif(torch.cuda.is_available(), reason="its fake cap would cap a real GPU; the gpu twin runs there")
@pytest.mark.parametrize("family", ["mixtral", "qwen3"])
def test_bench_small_gpu_source_auto_slots(family, capsys):
    """A ``--small`` run of each family with the experts regenerated for every peer and slots from a fake cap on
    the CPU: each offloaded row holds the slots :func:`auto_slots` gives its expert size (fewer for bf16 than for
    int4), the exact bf16 peer agrees with the build fully (the regenerated weights are the build's), the CPU
    compute row carries its host bound, and the bnb and CPU-only peers are rows."""
    args = small_args(family)
    model = build(args, torch.device("cpu"))
    resident = _resident_bytes(model)
    exact = ExpertLayout.from_stacked(find_moe_blocks(model)[0].expert_tensors(), args.experts)
    int4 = QuantizedExpertLayout.from_layout(exact, 4, 64)
    per_layer = args.layers * exact.nbytes
    cap = resident + 2 * per_layer + per_layer // 2  # room for two bf16 slots a layer
    want = {"bf16": auto_slots(cap, resident, args.layers, exact.nbytes, args.experts, 0),
            "int4": auto_slots(cap, resident, args.layers, int4.nbytes, args.experts, 0)}
    assert want["bf16"] == 2 < want["int4"]
    del model
    assert main(["--small", "--family", family, "--expert-source", "gpu", "--slots", "auto",
                 "--cap-gib", repr(cap / GIB), "--reserve-gib", "0", "--tokens", "8", "--agree-tokens", "20",
                 "--peers", "full,int4,bf16+cpu,ours,bnb,cpu", "--ours-variants", "default",
                 "--budget-s", BIG]) == 0
    out = capsys.readouterr().out
    assert "expert source: gpu" in out and "host memory bandwidth:" in out
    assert f"family={family}" in out and "agree tokens=20" in out and "decode tokens=8" in out
    assert "20-token greedy continuation" in out
    rows = table(out)
    for col in ("slots/layer", "token agree", "rel err", "PCIe bound tok/s", "host GB/token", "host bound tok/s"):
        assert col in rows["provider"].values(), col
    full = rows["full model on GPU (HF generate)"]
    ours = rows["ours: prefetch top-1, head staged (+96 MiB GPU; the default)"]
    q4 = rows["ours int4 (group 64)"]
    cpu = rows["ours bf16 + cpu_compute=misses"]
    for row in (full, ours, q4, cpu):
        assert float(row["tokens/s"]) > 0
    assert int(ours["slots/layer"]) == int(cpu["slots/layer"]) == want["bf16"]
    assert int(q4["slots/layer"]) == want["int4"]
    assert float(ours["token agree"]) == 1 and float(ours["rel err"]) == 0  # the same weights as the build
    assert float(cpu["token agree"]) == 1 and float(cpu["rel err"]) < 1e-4
    assert 0 < float(q4["rel err"]) < 0.5 and q4["host bound tok/s"] == ""  # only +cpu rows have a host bound
    assert float(cpu["host experts/token"]) > 0 and float(cpu["host bound tok/s"]) > 0
    # the two sides together bound higher than the host alone
    assert float(cpu["both bound tok/s"]) > float(cpu["host bound tok/s"])
    assert any(name.startswith("bitsandbytes nf4 experts") for name in rows)
    only = rows["CPU only (whole model on the host)"]
    assert float(only["tokens/s"]) > 0 and float(only["token agree"]) == 1


def test_bench_small_bnb_peer(capsys):
    """bitsandbytes' nf4 quantization of the fused expert tensors in place (not offloaded): a measured row near
    our int4's error, and the peers after it see the exact experts again."""
    pytest.importorskip("bitsandbytes.nn.parametrize")
    assert main(["--small", "--expert-source", "gpu", "--peers", "full,bnb,ours", "--ours-variants", "default",
                 "--tokens", "8", "--budget-s", BIG]) == 0
    rows = table(capsys.readouterr().out)
    bnb = next(row for name, row in rows.items() if name.startswith("bitsandbytes nf4 experts"))
    assert float(bnb["tokens/s"]) > 0 and 0 < float(bnb["rel err"]) < 0.5
    ours = rows["ours: prefetch top-1, head staged (+96 MiB GPU; the default)"]
    assert float(ours["token agree"]) >= 0.9 and float(ours["rel err"]) < 0.05


def test_bench_small_default_source_is_host(capsys):
    """A small model's experts are a host copy by default (well under 40% of host memory)."""
    assert main(["--small", "--peers", "int8", "--tokens", "4", "--budget-s", BIG]) == 0
    out = capsys.readouterr().out
    assert "expert source: host" in out and "slots/layer=2" in out
    assert float(table(out)["ours int8 (group 64)"]["slots/layer"]) == 2


def test_bench_small_router_skew(capsys):
    """--router-skew makes each layer's load uneven (a different expert popular in each layer); the default path
    decodes the skewed model, one row per --skip-resident value on the same offloaded model."""
    args = small_args("mixtral")
    args.init, args.router_skew = "scaled", 3.0
    blocks = find_moe_blocks(build(args, torch.device("cpu")))
    norms = [b.router.weight.detach().norm(dim=1) for b in blocks]
    assert all(float(n.max() / n.min()) > 2.5 for n in norms)
    assert not torch.equal(norms[0].argmax(), norms[1].argmax()) or not torch.equal(norms[0].argmin(),
                                                                                       norms[1].argmin())
    assert main(["--small", "--peers", "int4", "--tokens", "6", "--agree-tokens", "4", "--skip-resident", "off,on",
                 "--router-skew", "3", "--budget-s", BIG]) == 0
    rows = table(capsys.readouterr().out)
    for skip in ("off", "on"):
        assert float(rows[f"ours int4 (group 64), skip resident {skip}"]["tokens/s"]) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mixtral", "qwen3"])
def test_bench_small_cuda_capped_gpu_source(family, capsys):
    """On CUDA: the experts regenerated on the GPU for every peer with the cap lifted, each timed decode under
    the cap again (its peak within it), slots per layer from the cap, the bf16 cache agreeing with the model."""
    cap = 2.5
    try:
        assert main(["--small", "--family", family, "--expert-source", "gpu", "--slots", "auto", "--cap-gib",
                     str(cap), "--agree-tokens", "24", "--peers", "full,int4,int4+cpu,ours", "--ours-variants",
                     "default", "--budget-s", BIG]) == 0
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)  # the later tests of the session run uncapped
    out = capsys.readouterr().out
    assert "expert source: gpu" in out and f"GPU cap GiB={cap}" in out
    rows = table(out)
    offloaded = [rows["ours int4 (group 64)"], rows["ours int4 (group 64) + cpu_compute=misses"],
                 rows["ours: prefetch top-1, head staged (+96 MiB GPU; the default)"]]
    for row in offloaded:
        assert float(row["tokens/s"]) > 0 and float(row["peak GiB"]) <= cap
        assert 1 <= int(row["slots/layer"]) <= (16 if family == "qwen3" else 8)
        assert 0 <= float(row["token agree"]) <= 1
    assert float(offloaded[2]["token agree"]) >= 0.9
    assert float(offloaded[1]["host bound tok/s"]) > 0


def test_union_length_counts_overlaps_once():
    assert union_length([]) == 0
    assert union_length([(0, 10), (5, 15), (20, 25), (21, 22), (25, 25)]) == 20   # [0, 15] and [20, 25]
    assert union_length([(3, 4), (0, 1)]) == 2


def test_gpu_busy_profiles_a_decode(tmp_path):
    """The profiled decode runs through ``generate`` and writes its op table; on the CPU nothing is device time."""
    model = build(small_args("mixtral"), torch.device("cpu"))
    out = tmp_path / "p.txt"
    got = gpu_busy(model, torch.tensor([[1, 2, 3]]), 3, out=str(out), name="peer x")
    assert got == {"GPU busy %": 0.0}
    text = out.read_text()
    assert text.startswith("## peer x: 2 decode steps, wall ") and "Self CPU" in text
    assert "(timeline: p.txt.0.json)" in text and (tmp_path / "p.txt.0.json").stat().st_size > 0


def test_bench_small_decode_graphs_rows(capsys):
    """--decode-graphs off,static,on: a row each on the same offloaded model (a dynamic KV cache, a static one, and
    the static one through the split forward, which runs without graphs on a CPU); the same greedy tokens."""
    assert main(["--small", "--peers", "int4", "--tokens", "6", "--agree-tokens", "4", "--decode-graphs",
                 "off,static,on", "--budget-s", BIG]) == 0
    rows = table(capsys.readouterr().out)
    got = [rows[f"ours int4 (group 64), decode graphs {m}"] for m in ("off", "static", "on")]
    assert all(float(r["tokens/s"]) > 0 for r in got)
    assert len({r["token agree"] for r in got}) == 1
    # the split forward's counters: no graph on a CPU; every decode step of each of --small's 4 layers took the
    # split in the "on" row, none in the others
    assert [float(r["graph replays/token"]) for r in got] == [0, 0, 0]
    assert [float(r["split eager/token"]) for r in got] == [0, 0, 4] and "graphs failed" not in got[2]
