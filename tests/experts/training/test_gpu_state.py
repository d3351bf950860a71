"""``moe.gpu_state_experts``: the first experts keep their master and optimizer state on the compute device and are
always stepped on the split step's device side. On a CPU run the "device" tables are a second CPU copy, so these tests
check the bookkeeping (the tier's rows brought up to date before every read, the device's after every write) and that
results equal plain DeepSpeed and the same run without the option, bit for bit (the GPU test is in test_gpu.py)."""
import pytest
import torch

from ds_maximus.errors import ConfigError
from tests.experts.training.moe_utils import batches, build, mixtral_experts, moe_section, tiny_mixtral
from tests.helpers.models import train


def _sec(n, **kw):
    return moe_section(slots=3, optimizer_device="split", cpu_step_share=0.5, step_chunk_bytes=1 << 16,
                       gpu_state_experts=n, **kw)


def _equal_experts(a, b):
    ea, eb = mixtral_experts(a), mixtral_experts(b)
    for g in ea:
        for n in ea[g]:
            assert torch.equal(ea[g][n], eb[g][n]), (g, n)


@pytest.mark.parametrize("n,stage,gas,ffn", [(3, 2, 1, 48), (16, 2, 1, 48), (5, 3, 2, 48), (4, 2, 1, 192)])
def test_device_state_experts_equal_the_tier_only_run(n, stage, gas, ffn):
    """3 of 16 experts (some of layer 0), all of them, 5 under ZeRO-3 with 2 micro-batches a step, or 4 experts
    larger than a gradient piece (``step_chunk_bytes``: 3 x 32 x 192 elements, in 2 pieces): the same losses,
    experts and tier as the split step without the option (which test_equality holds to plain DeepSpeed), bit for
    bit; experts that skipped steps are caught up too."""
    data = batches(10 * gas, batch=2, seqlen=4)
    plain = build(tiny_mixtral(num_experts=8, ffn=ffn), stage, gas=gas, maximus=_sec(0), clip=0.5)
    l_plain = train(plain, data)
    got = build(tiny_mixtral(num_experts=8, ffn=ffn), stage, gas=gas, maximus=_sec(n), clip=0.5)
    l_got = train(got, data)
    t = got.maximus.modules["moe"]
    assert sorted(t.store.resident) == list(range(min(n, t.num_uids)))
    assert l_got == l_plain
    _equal_experts(got, plain)
    assert t.counters.caught_up > 0, "no expert skipped a step: catch-up of a device expert is not exercised"
    sides = t.stats()["last_step"]["split_sides"]
    assert sides["device_experts"] > 0 and (sides["cpu_experts"] == 0 if n >= t.num_uids else True)
    for name, tab in plain.maximus.modules["moe"].store.state().items():  # the tier, brought up to date
        assert torch.equal(t.store.state()[name], tab), name


def test_device_rows_are_the_newest_until_read():
    """After a step the tier's rows of a device expert are stale; reading them (a checkpoint, an export) brings
    them up to date first, and a write to the tier reaches the device copy."""
    data = batches(2, batch=2, seqlen=4)
    e = build(tiny_mixtral(num_experts=8), 2, maximus=_sec(2), clip=0.5)
    train(e, data)
    t = e.maximus.modules["moe"]
    st = t.store
    assert st._newer, "the step did not mark its device rows"
    stale = st.tables["exp_avg"][0].clone()
    newest = {n: v.clone() for n, v in st.device_tables.items()}
    assert not torch.equal(stale, st.device_tables["exp_avg"][0])
    st.make_resident(list(st.resident), torch.device("cpu"))  # what following the model to another device does
    for n, v in newest.items():
        assert torch.equal(st.device_tables[n], v), n
    train(e, data)
    assert torch.equal(st.state()["exp_avg"][0], st.device_tables["exp_avg"][0]) and not st._newer
    ones = {k: torch.ones_like(v[0]) for k, v in t.expert_tensors(0).items()}
    t.load_expert_tensors(0, {k: v[None].expand(t.num_experts, *v.shape) for k, v in ones.items()})
    assert torch.equal(st.device_tables["weight"][1], st.tables["weight"][1])
    assert float(st.device_tables["weight"][1].sum()) == t.numel


def test_resume_with_device_state_is_exact(tmp_path):
    data = batches(8, batch=2, seqlen=4)
    full = build(tiny_mixtral(num_experts=8), 2, maximus=_sec(5), clip=0.5)
    ref = train(full, data)
    first = build(tiny_mixtral(num_experts=8), 2, maximus=_sec(5), clip=0.5)
    train(first, data[:4])
    first.save_checkpoint(str(tmp_path), tag="s4")
    resumed = build(tiny_mixtral(num_experts=8, seed=7), 2, maximus=_sec(5), clip=0.5)
    resumed.load_checkpoint(str(tmp_path), tag="s4")
    assert train(resumed, data[4:]) == ref[4:]
    _equal_experts(resumed, full)


def test_device_state_needs_the_split_step_and_a_memory_tier(tmp_path):
    with pytest.raises(Exception, match="gpu_state_experts=2 needs \"optimizer_device\": \"split\""):
        build(tiny_mixtral(num_experts=8), 2, maximus=moe_section(slots=3, gpu_state_experts=2))
    with pytest.raises(ConfigError, match="tier in CPU memory"):
        build(tiny_mixtral(num_experts=8), 2, maximus=_sec(2, offload={"device": "nvme", "nvme_path": str(tmp_path)}))



def test_device_bytes_adds_up_the_trainers_buffers_by_use():
    """``device_bytes`` (the benchmark's memory line): the slots, the device-state experts' fp32 master and two
    moments, the step pipeline's buffers, the gradients not sent to the host (none once a step has run) and those
    still leaving (host accumulation's copies out)."""
    e = build(tiny_mixtral(num_experts=8), 2, maximus=_sec(3), clip=0.5)
    train(e, batches(2, batch=2, seqlen=4))
    t = e.maximus.modules["moe"]
    use = t.device_bytes()
    slot_bytes = t.numel * t.cache.layout.dtype.itemsize
    assert use["expert slots"] >= t.num_layers * t.cache.slots_per_group * slot_bytes
    assert use["device-state experts"] == 3 * 3 * t.numel * 4
    assert use["expert gradients"] == 0  # the step consumed them
    assert set(use) == {"expert slots", "device-state experts", "step pipeline", "expert gradients"}
