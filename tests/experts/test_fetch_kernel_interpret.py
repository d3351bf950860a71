"""The fetch kernel of moe.device_fetch run by Triton's interpreter on the host (``TRITON_INTERPRET=1``), where
triton is installed but no GPU is: which experts it copies from the "host tier" (a separate allocation, reached by an
offset from the staging buffers as the CUDA kernel reaches pinned memory), where it tells the gemv to read each one, a
guess read from its own buffers and not copied again, and the one-row gemv over those places against the dequantized
reference; then whole decodes through the kernels. Skips without triton (as in CI); the same kernel on a GPU:
``test_device_fetch.py``'s ``gpu`` tests."""
from .test_quant_interpret import run_interpreted

SCRIPT = r'''
import torch
from ds_maximus.experts import quant_triton as qt
from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.experts.quant import dequantize
from ds_maximus.experts.quant_layout import QuantizedExpertLayout
qt._sm_count = lambda device: 4  # the interpreter has no device to ask; 4 makes the gemv split K
g = torch.Generator().manual_seed(0)
H, F, E, K, P = 128, 96, 5, 2, 1
for bits in (8, 4, 2):
    t = {"gate_up_proj": torch.randn(E, 2 * F, H, generator=g) * 0.02,
         "down_proj": torch.randn(E, H, F, generator=g) * 0.02}
    lay = QuantizedExpertLayout.from_layout(ExpertLayout.from_stacked(t, E), bits, 32)
    n = lay.numel
    host = torch.zeros(E, n, dtype=torch.uint8)            # the CPU tier: every expert
    for e in range(E):
        lay.pack_(host[e], {k: v[e] for k, v in t.items()})
    table = torch.full((3, n), 7, dtype=torch.uint8)       # the layer's slots: expert 3 in slot 0, 0 in slot 2
    table[0].copy_(host[3])
    table[2].copy_(host[0])
    slot_off = torch.full((E,), -1, dtype=torch.long)
    slot_off[3], slot_off[0] = 0, 2 * n
    buffers = torch.full((K + 2 * P, n), 9, dtype=torch.uint8)  # K step buffers, then two sets of P guess buffers
    stage = buffers[:K]
    host_off = torch.tensor([(host[e].data_ptr() - buffers.data_ptr()) // 4 for e in range(E)], dtype=torch.long)
    assert all((host[e].data_ptr() - buffers.data_ptr()) % 16 == 0 for e in range(E))
    stage_off = stage.data_ptr() - table.data_ptr()

    def gemv(meta, ids):
        out = {}
        for name, cols in (("gate_up_proj", H), ("down_proj", F)):
            x = torch.randn(len(ids), cols, generator=g)
            want = torch.cat([x[i:i + 1] @ dequantize(lay.view(host[e], name)).t() for i, e in enumerate(ids)])
            for config in (qt.decode_config(bits), qt.GemvConfig(16, 16, 4, 2, 8)):
                y = qt.quant_matmul_grouped(x, table, lay.parts[name], lay.base.shapes[name], bits, 32, meta,
                                            len(ids), 1, config=config)
                assert ((y - want).abs().max() / want.abs().max()).item() < 1e-5, (bits, name, config, ids)

    # a resident expert and a missed one: only the miss is copied, into its step buffer
    meta = torch.tensor(list(range(K + 1)) + [0] * K, dtype=torch.long)
    ids = torch.tensor([0, 4])
    qt.fetch_experts(stage, ids, slot_off, host_off, meta, stage_off, block=256)
    assert torch.equal(stage[1], host[4]) and bool((stage[0] == 9).all()), "only the missed expert is copied"
    assert meta[K + 1:].tolist() == [2 * n, stage_off + n]
    gemv(meta, [0, 4])

    # a guess fetched into the guess buffers of parity 1 (host_shift: its rows start K + P rows in), then a step
    # routed to the guess and a miss: the guess is read where the first call put it, not copied again
    rows = buffers[K + P:K + 2 * P]
    gmeta = torch.tensor(list(range(P + 1)) + [0] * P, dtype=torch.long)
    guess = torch.tensor([1])
    qt.fetch_experts(rows, guess, slot_off, host_off, gmeta, rows.data_ptr() - table.data_ptr(),
                     host_shift=-(K + P) * (n // 4), block=256)
    assert torch.equal(rows[0], host[1]) and gmeta[P + 1:].tolist() == [rows.data_ptr() - table.data_ptr()]
    stage.fill_(9)
    ids = torch.tensor([1, 2])
    qt.fetch_experts(stage, ids, slot_off, host_off, meta, stage_off, pred=guess, pred_place=gmeta[P + 1:],
                     block=256)
    assert bool((stage[0] == 9).all()) and torch.equal(stage[1], host[2]), "the guess is not copied again"
    assert meta[K + 1:].tolist() == [rows.data_ptr() - table.data_ptr(), stage_off + n]
    gemv(meta, [1, 2])

    # a guess that is resident copies nothing and points at its slot; a wrong guess changes nothing of the step
    rows.fill_(9)
    qt.fetch_experts(rows, torch.tensor([3]), slot_off, host_off, gmeta, rows.data_ptr() - table.data_ptr(),
                     host_shift=-(K + P) * (n // 4), block=256)
    assert bool((rows == 9).all()) and gmeta[P + 1:].tolist() == [0]
    stage.fill_(9)
    ids = torch.tensor([0, 4])
    qt.fetch_experts(stage, ids, slot_off, host_off, meta, stage_off, pred=torch.tensor([3]),
                     pred_place=gmeta[P + 1:], block=256)
    assert meta[K + 1:].tolist() == [2 * n, stage_off + n] and torch.equal(stage[1], host[4])
    gemv(meta, [0, 4])
print("ok")
'''


def test_fetch_kernel_under_the_triton_interpreter():
    run_interpreted(SCRIPT)


DECODE = r'''
import torch
from ds_maximus.experts import offload_experts, quant_triton as qt
from ds_maximus.experts import device_fetch
from ds_maximus.experts.device_fetch import DeviceFetch
from tests.experts.test_offload_generate import greedy
from tests.experts.test_quant_offload import GROUP, prompt
from tests.experts.tiny_moe import clone, tiny_model
qt._sm_count = lambda device: 4
device_fetch.SWAP_Z, device_fetch.SWAP_MIN = 0.0, 0.5  # refreshes swap on any count difference
for kind, top_k, extra in (("mixtral", 2, {}), ("qwen3_moe", 4, {"prefetch_skip_resident": True}),
                           ("mixtral", 2, {"prefetch_top_k": 2})):
    model = tiny_model(kind, "eager", layers=3, top_k=top_k)
    cfg = {"gpu_experts_per_layer": 2, "quant": {"bits": 4, "group_size": GROUP[kind]}, **extra}
    prompts = [prompt(), prompt(length=9)[:, 3:]]
    ref_model = clone(model)
    h = offload_experts(ref_model, cfg)
    ref = [greedy(ref_model, ids, 8) for ids in prompts]
    h.close()
    h = offload_experts(model, {**cfg, "device_fetch": True})
    # the CUDA branch (fetch kernel, guesses in their buffers, the one-row gemv, slots refreshed every 3 tokens)
    # on the host, in one stream
    h._device_fetch = DeviceFetch(h.cache, top_k, min(h.cfg.guesses(top_k), top_k), kernels=True, refresh=3)
    got = [greedy(model, ids, 8) for ids in prompts]
    st = h.stats()
    h.close()
    for (seq_r, log_r), (seq, log) in zip(ref, got):
        assert torch.equal(seq, seq_r), kind
        torch.testing.assert_close(log, log_r, rtol=1e-4, atol=1e-4)  # the gemv's fp32 sums against quant.linear's
    assert st["prefetch_issued"] > 0 and st["prefetch_useful"] > 0, st
    assert st["hits"] + st["misses"] == st["lookups"] and st["device_fetches"] > 0, st
    assert st["device_fetch_swaps"] > 0, st
print("ok")
'''


def test_device_fetch_decode_under_the_triton_interpreter():
    """The whole device-fetch step as on CUDA (the fetch kernel, guesses fetched into their own buffers and read
    from there, the one-row gemv, slots swapped between tokens) in one stream: the default path's tokens, its
    logits within fp32 sums."""
    run_interpreted(DECODE, timeout=900)
