"""The staged (device-side) AdamW step of a CPU-placed LM head against the host step (the reference).

On this CPU machine the staged pipeline runs with ``device=cpu`` (the same code without streams), so
it must equal the host path bit for bit; the GPU test states its tolerance.
"""
import pytest
import torch

from ds_maximus.vocab import ShardedLMHead
from ds_maximus.vocab.lm_head_tier import HeadTier
from tests.helpers.threads import torch_threads

V, D, CHUNK = 23, 6, 5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def _grad_plan(seed):
    """Per step: micro-batches of (lo, hi, grad) chunk gradients; step 2 leaves chunks without a gradient."""
    g = torch.Generator().manual_seed(seed)
    chunks = [(lo, min(V, lo + CHUNK)) for lo in range(0, V, CHUNK)]
    plan = []
    for step in range(4):
        use = chunks if step != 2 else chunks[1:3]
        micro = [[(lo, hi, torch.randn(hi - lo, D, generator=g)) for lo, hi in use] for _ in range(2)]
        plan.append(micro)
    return plan


def _run(tier, plan, scale=0.5, wd=0.1):
    norms = []
    for micro in plan:
        for chunks in micro:
            for lo, hi, grad in chunks:
                tier.add_grad_(lo, hi, grad)
        norms.append(float(tier.grad_norm_sq()))
        assert tier.grads_finite()
        tier.scale_grads_(scale)
        assert tier.step_(lr=0.05, weight_decay=wd)
    tier.sync()
    return norms


@pytest.mark.parametrize("update_rows", [1, 4, 7, 64])
def test_staged_step_equals_host_step_bitwise(update_rows):
    w0 = torch.randn(V, D, generator=torch.Generator().manual_seed(1))
    host = HeadTier(w0, CHUNK, update_device="host")
    staged = HeadTier(w0, CHUNK, update_device="cpu", update_rows=update_rows)
    for t in (host, staged):
        t.host_rows(0, V, torch.bfloat16)          # a compute-dtype mirror, refreshed by each step
    plan = _grad_plan(0)
    n_host, n_staged = _run(host, plan), _run(staged, plan)
    assert staged._staged_opt is not None       # the staged pipeline ran
    torch.testing.assert_close(torch.tensor(n_staged), torch.tensor(n_host), rtol=1e-6, atol=0)
    for name in ("weight", "exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(staged, name), getattr(host, name)), name
    assert torch.equal(staged._mirrors[torch.bfloat16], host._mirrors[torch.bfloat16])
    assert torch.equal(staged._mirrors[torch.bfloat16], staged.weight.to(torch.bfloat16))
    assert staged.step == host.step == 4 and staged.lr_history == host.lr_history
    assert not staged.has_grads()


def test_staged_step_not_a_no_op_and_state_round_trip():
    w0 = torch.randn(V, D)
    tier = HeadTier(w0, CHUNK, update_device="cpu", update_rows=8)
    _run(tier, _grad_plan(3)[:2])
    assert not torch.equal(tier.weight, w0)
    other = HeadTier(torch.zeros(V, D), CHUNK, update_device="host")
    other.load_state_dict(tier.state_dict())
    plan = _grad_plan(4)[:1]
    _run(tier, plan)
    _run(other, plan)
    assert torch.equal(tier.weight, other.weight) and torch.equal(tier.exp_avg_sq, other.exp_avg_sq)


@pytest.mark.parametrize("update_device", ["cpu", "host"])
def test_grad_on_device_fp32_equals_the_tier_gradient_bitwise(update_device):
    """grad_on_device fp32: the gradient accumulates where its chunks come from (here the CPU stands in for
    the GPU) and the step reads it in place; the result is the CPU-tier gradient's, bit for bit."""
    w0 = torch.randn(V, D, generator=torch.Generator().manual_seed(1))
    ref = HeadTier(w0, CHUNK, update_device=update_device, update_rows=7)
    got = HeadTier(w0, CHUNK, update_device=update_device, update_rows=7, grad_on_device=torch.float32)
    plan = _grad_plan(0)
    n_ref, n_got = _run(ref, plan), _run(got, plan)
    torch.testing.assert_close(torch.tensor(n_got), torch.tensor(n_ref), rtol=1e-6, atol=0)
    for name in ("weight", "exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert got.grad is None and got.dgrad is not None  # never in the CPU tier


def test_grad_on_device_bf16_stores_the_accumulated_gradient_rounded():
    """grad_on_device bf16: each micro-batch is added in fp32 and the sum stored in bf16 (what plain bf16
    DeepSpeed keeps); the norm the clipping sees is that of the stored gradient."""
    w0 = torch.randn(V, D, generator=torch.Generator().manual_seed(1))
    got = HeadTier(w0, CHUNK, update_device="cpu", update_rows=7, grad_on_device=torch.bfloat16)
    ref = HeadTier(w0, CHUNK, update_device="cpu", update_rows=7)
    plan = _grad_plan(0)[:1]
    want = torch.zeros(V, D, dtype=torch.bfloat16)
    for chunks in plan[0]:
        for lo, hi, g in chunks:
            want[lo:hi] = (want[lo:hi].float() + g).to(torch.bfloat16)
    n_got, n_ref = _run(got, plan), _run(ref, plan)
    torch.testing.assert_close(n_got[0], float(want.double().pow(2).sum()), rtol=1e-6, atol=0)  # fp32 norm
    assert n_got[0] != n_ref[0]
    torch.testing.assert_close(got.weight, ref.weight, rtol=0, atol=1e-4)  # lr 0.05, one step


@pytest.mark.parametrize("grad_on_device", ["off", "fp32"])
def test_partial_set_sparse_grads_falls_back_to_host_norm(grad_on_device):
    head = ShardedLMHead(V, D, config={"placement": "cpu", "chunk_rows": CHUNK, "grad_on_device": grad_on_device},
                         update_device="cpu")
    ids = torch.tensor([0, 3, 17])
    rows = torch.randn(3, D)
    head.set_sparse_grads_(ids, rows)
    torch.testing.assert_close(head.sparse_grad_norm_sq(), rows.double().pow(2).sum().float())
    got_ids, got_rows = head.sparse_grads()
    assert torch.equal(got_ids, ids) and torch.equal(got_rows, rows)


def _head_losses(update_device, steps=3, grad_on_device="off"):
    torch.manual_seed(0)
    head = ShardedLMHead(V, D, config={"placement": "cpu", "chunk_rows": CHUNK, "grad_on_device": grad_on_device},
                         update_device=update_device, update_rows=6)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        h = torch.randn(4, 7, D, generator=g)
        y = torch.randint(0, V, (4, 7), generator=g)
        loss = head(h, y)
        loss.backward()
        ids, rows = head.sparse_grads()            # the runtime's data-parallel round trip (one rank)
        head.set_sparse_grads_(ids, rows)
        assert head.sparse_grads_finite()
        head.scale_sparse_grads_(0.7)
        head.sparse_step(lr=0.01, weight_decay=0.01)
        losses.append(float(loss.detach()))
    return losses, head.full_weight().clone()


@pytest.mark.parametrize("grad_on_device", ["off", "fp32"])
def test_head_end_to_end_staged_equals_host(grad_on_device):
    l_host, w_host = _head_losses("host")
    l_staged, w_staged = _head_losses("cpu", grad_on_device=grad_on_device)
    assert l_host == l_staged
    assert torch.equal(w_host, w_staged)


def test_dense_sparse_grads_round_trip_is_copy_free():
    head = ShardedLMHead(V, D, config={"placement": "cpu", "chunk_rows": CHUNK}, update_device="cpu")
    head(torch.randn(3, D), torch.randint(0, V, (3,))).backward()
    ids, rows = head.sparse_grads()
    assert ids.numel() == V and rows.data_ptr() == head.tier.grad.data_ptr()
    before = float(head.sparse_grad_norm_sq())
    head.set_sparse_grads_(ids, rows)
    assert head.tier._sq_ok and float(head.sparse_grad_norm_sq()) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_staged_step_matches_host_step():
    """GPU elementwise AdamW may fuse multiply-adds: stated tolerance 1e-6 relative after 4 steps."""
    w0 = torch.randn(V * 40, D * 8)
    host = HeadTier(w0, CHUNK * 40, update_device="host")
    gpu = HeadTier(w0, CHUNK * 40, update_device="cuda", update_rows=100)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        for lo in range(0, w0.shape[0], CHUNK * 40):
            hi = min(w0.shape[0], lo + CHUNK * 40)
            grad = torch.randn(hi - lo, w0.shape[1], generator=g)
            host.add_grad_(lo, hi, grad)
            gpu.add_grad_(lo, hi, grad.cuda())
        torch.testing.assert_close(gpu.grad_norm_sq().cpu(), host.grad_norm_sq(), rtol=1e-5, atol=0)
        host.scale_grads_(0.5)
        gpu.scale_grads_(0.5)
        host.step_(lr=1e-3, weight_decay=0.1)
        gpu.step_(lr=1e-3, weight_decay=0.1)
    gpu.sync()
    for name in ("weight", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(getattr(gpu, name), getattr(host, name), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("grad_on_device", ["off", "fp32"])
def test_train_llama_cpu_head_equals_plain_deepspeed(tmp_path, grad_on_device):
    """ds_maximus.initialize with lm_head.placement cpu (the replaced head dropped from DeepSpeed, its AdamW
    betas taken from DeepSpeed's) trains like plain ZeRO-2 in fp32: losses within 1e-5 over 6 steps (with
    the head's gradient in the CPU tier, or kept where it is computed)."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                     "weight_decay": 0.1, "torch_adam": True}},
           "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
           "maximus": {"embedding": {"gpu_cache_rows": 512, "min_rows": 1000, "optimizer": {"mode": "exact"}},
                       "lm_head": {"enabled": True, "placement": "cpu", "chunk_rows": 700,
                                   "grad_on_device": grad_on_device}}}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    losses = {}
    for plain in (False, True):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        out = tmp_path / f"{plain}.json"
        cmd = [sys.executable, str(root / "examples" / "train_llama.py"), "--deepspeed_config",
               str(tmp_path / "ds.json"), "--vocab", "2048", "--hidden", "32", "--layers", "1", "--seq", "16",
               "--steps", "6", "--json-out", str(out)] + (["--plain"] if plain else [])
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
        assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-2500:]
        losses[plain] = json.loads(out.read_text())["losses"]
    assert len(losses[False]) == 6
    assert losses[False][-1] < losses[False][0]
    torch.testing.assert_close(torch.tensor(losses[False]), torch.tensor(losses[True]), rtol=0, atol=1e-5)


def _steps_fetching_like_the_forward(gpu, host, w0, host_grad_dtype=torch.float32, scale=None, steps=4):
    """``steps`` steps of a CUDA tier and a host tier on the same gradients, each chunk fetched first as the
    forward does (the fetch moves the master to the GPU and launches a held step) and checked against the
    host's rows; the host's gradient is rounded through ``host_grad_dtype`` (the GPU one keeps it so)."""
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for lo in range(0, w0.shape[0], CHUNK * 40):
            hi = min(w0.shape[0], lo + CHUNK * 40)
            grad = torch.randn(hi - lo, w0.shape[1], generator=g)
            torch.testing.assert_close(gpu.fetch(lo, hi, torch.device("cuda"), torch.float32).cpu(),
                                       host.weight[lo:hi], rtol=1e-6, atol=1e-7)
            host.add_grad_(lo, hi, grad.to(host_grad_dtype).float())
            gpu.add_grad_(lo, hi, grad.cuda())
        if scale is not None:
            gpu.scale_grads_(scale)
            host.scale_grads_(scale)
        host.step_(lr=1e-3, weight_decay=0.1)
        gpu.step_(lr=1e-3, weight_decay=0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_gpu_master_on_device_matches_host_step_and_fetch_sees_the_update(defer):
    """placement cpu_optimizer: the fp32 master moves to the GPU on first use and is updated in place there;
    only moments and gradient are staged. Same tolerance as the staged step; the chunk fetched after a step
    (the next forward) carries that step's update."""
    w0 = torch.randn(V * 40, D * 8)
    host = HeadTier(w0, CHUNK * 40, update_device="host")
    gpu = HeadTier(w0, CHUNK * 40, update_device="cuda", update_rows=100, master_on_device=True)
    gpu.defer_steps = defer          # deferred: the next fetch launches the held step
    _steps_fetching_like_the_forward(gpu, host, w0)
    assert gpu.weight.is_cuda and gpu.exp_avg.device.type == "cpu"
    assert gpu.counters["bytes_h2d"] == 4 * V * 40 * D * 8 * 12  # moments + gradient only
    torch.testing.assert_close(gpu.master_cpu(), host.weight, rtol=1e-6, atol=1e-7)
    for name in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(getattr(gpu, name), getattr(host, name), rtol=1e-6, atol=1e-7)
    state = gpu.state_dict()
    assert state["weight"].device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_grad_on_device_matches_host_step(dtype):
    """placement cpu_optimizer + grad_on_device: master and gradient stay on the GPU, only the moments
    cross PCIe (8 B/param each way); fp32 matches the host step like the staged step, bf16 within its
    rounding; the deferred step is joined before the next backward writes the gradient."""
    w0 = torch.randn(V * 40, D * 8)
    host = HeadTier(w0, CHUNK * 40, update_device="host")
    gpu = HeadTier(w0, CHUNK * 40, update_device="cuda", update_rows=100, master_on_device=True, grad_on_device=dtype)
    gpu.defer_steps = True
    _steps_fetching_like_the_forward(gpu, host, w0, host_grad_dtype=dtype, scale=0.5)
    gpu.sync()
    assert gpu.dgrad.is_cuda and gpu.dgrad.dtype == dtype and gpu.grad is None
    assert gpu.counters["bytes_h2d"] == 4 * V * 40 * D * 8 * 8 and gpu.counters["bytes_d2h"] == 4 * V * 40 * D * 8 * 8
    torch.testing.assert_close(gpu.master_cpu(), host.weight, rtol=1e-6, atol=1e-7)


def test_cpu_optimizer_placement_equals_cpu_placement_on_cpu():
    """On a machine without a GPU the cpu_optimizer head is the cpu head (master stays where the rows are)."""
    w = torch.randn(V, D)
    heads = [ShardedLMHead(config={"placement": p, "chunk_rows": CHUNK}, weight=w, update_device="cpu")
             for p in ("cpu", "cpu_optimizer")]
    assert heads[1].placement == "cpu_optimizer" and heads[1].owns_weights
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        h, y = torch.randn(7, D, generator=g), torch.randint(0, V, (7,), generator=g)
        for head in heads:
            head(h, y).backward()
            head.sparse_step(lr=1e-2, weight_decay=0.1)
    assert torch.equal(heads[0].full_weight(), heads[1].full_weight())


def test_pending_step_returns_the_result_and_re_raises_the_workers_error():
    from ds_maximus.vocab.lm_head_update import PendingStep
    assert PendingStep(lambda: 42).event() == 42

    def boom():
        raise RuntimeError("disk on fire")
    with pytest.raises(RuntimeError, match="disk on fire"):
        PendingStep(boom).event()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_background_step_equals_foreground_step_bitwise():
    """The worker-thread issue (throttled to two queued blocks) runs the very same kernels in the same order."""
    from ds_maximus.vocab.lm_head_update import PendingStep, StagedAdamW
    g = torch.Generator().manual_seed(3)
    w0, grad = torch.randn(1000, 64, generator=g), torch.randn(1000, 64, generator=g)
    outs = []
    for background in (False, True):
        host = {"weight": w0.clone().pin_memory(), "exp_avg": torch.zeros(1000, 64).pin_memory(),
                "exp_avg_sq": torch.zeros(1000, 64).pin_memory(), "grad": grad.clone().pin_memory()}
        opt = StagedAdamW(torch.device("cuda"), 96, 64)
        for step in (1, 2, 3):
            r = opt.step(host, torch.ones(1000, dtype=torch.bool), {}, step=step, lr=1e-2, beta1=0.9, beta2=0.99,
                         eps=1e-8, weight_decay=0.1, grad_scale=0.5, background=background)
            assert isinstance(r, PendingStep) == background
            ev = r.event() if background else r
            ev.synchronize()
        outs.append({k: v.clone() for k, v in host.items()})
    for k in outs[0]:
        assert torch.equal(outs[0][k], outs[1][k]), k


def test_deferred_step_equals_immediate_step_bitwise():
    """``defer_steps``: nothing moves at ``step_``; the launch (explicit, or the first use of the state: the
    next gradient, a fetch, a checkpoint) gives the very same result as an immediate step."""
    w0 = torch.randn(V, D)
    ref = HeadTier(w0, CHUNK, update_device="cpu", update_rows=7)
    lazy = HeadTier(w0, CHUNK, update_device="cpu", update_rows=7)
    lazy.defer_steps = True
    plan = _grad_plan(5)
    for i, micro in enumerate(plan):
        for tier in (ref, lazy):
            for chunks in micro:
                for lo, hi, grad in chunks:
                    tier.add_grad_(lo, hi, grad)   # the second step's first gradient launches the first step
            tier.scale_grads_(0.5)
            assert tier.step_(lr=0.05, weight_decay=0.1)
        assert lazy._deferred is not None
        if i == 0:                                          # held back: the weight is still the initial one
            assert torch.equal(lazy.weight, w0) and not torch.equal(ref.weight, w0)
        if i == 1:
            lazy.launch_deferred_step()
            assert lazy._deferred is None
    state = lazy.state_dict()                               # launches the last one
    assert lazy._deferred is None
    for name in ("weight", "exp_avg", "exp_avg_sq"):
        assert torch.equal(state[name], ref.state_dict()[name]), name


def test_launching_a_deferred_step_does_not_wait_for_its_issue_thread():
    """The forward hook's launch returns while the worker thread is still issuing the step's blocks (it had
    joined the thread: the forward's host thread then waited ~95 ms per step on the H200); the first use of
    the state joins it, and a worker's error reaches the caller there."""
    import threading
    import time

    from ds_maximus.vocab.lm_head_update import PendingStep
    tier = HeadTier(torch.randn(V, D), CHUNK, update_device="cpu", update_rows=7)
    release = threading.Event()

    def issue():                                   # stands in for StagedAdamW._issue's throttled loop
        if not release.wait(timeout=10):
            raise TimeoutError("never released")
        raise RuntimeError("worker failed")
    tier._deferred = lambda: setattr(tier, "_step_event", PendingStep(issue))
    t0 = time.perf_counter()
    tier.launch_deferred_step()
    assert time.perf_counter() - t0 < 2 and tier._deferred is None
    assert isinstance(tier._step_pending, PendingStep)
    release.set()
    with pytest.raises(RuntimeError, match="worker failed"):
        tier._step_event                           # noqa: B018 - the getter joins


def test_runtime_defers_the_head_step_to_the_embeddings_forward(tmp_path):
    """Under ds_maximus.initialize (ZeRO-2, fp32, CPU) with a sharded embedding and a CPU-tier head whose step
    runs staged (update_device cpu: the GPU code path without streams): the step is held at engine.step(),
    launched by the next forward's embedding, and the losses equal the same run without deferral."""
    from ds_maximus.vocab.lm_head_tier import HeadTier
    from tests.engine.llama_utils import build, maximus_section
    from tests.helpers.models import zipf_batches
    section = maximus_section(cache_rows=64)
    section["lm_head"] = {"enabled": True, "placement": "cpu", "chunk_rows": 100}
    batches = zipf_batches(5, 2, 16)
    init = None
    losses = {}
    for defer in (True, False):
        engine = build(2, "fp32", maximus=section, seed=0, init=init, clip=1.0)
        tier = engine.maximus.modules["lm_head"].tier
        assert isinstance(tier, HeadTier) and tier.defer_steps
        tier.update_device = torch.device("cpu")        # the staged (device) path, run on the CPU
        tier.defer_steps = defer
        out = []
        for ids in batches:
            loss = engine(input_ids=ids, labels=ids).loss
            assert tier._deferred is None                  # the embedding's forward launched it
            engine.backward(loss)
            engine.step()
            assert (tier._deferred is not None) == defer
            out.append(float(loss.detach()))
        losses[defer] = out
    assert losses[True] == losses[False]
    assert losses[True][-1] < losses[True][0]
