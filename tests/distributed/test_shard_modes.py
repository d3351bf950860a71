"""Every shard mode under the ``deepspeed`` launcher (CPU ranks, gloo) trains a tiny Llama 20 steps
equal to one rank with the same global batch (exact AdamW, fp32, clipping on); partitioned mode
holds 1/N of the table per rank; a checkpoint saved on 4 ranks resumes on 2 and continues equal.

Two launches in all (4 ranks, then 2 ranks): the machine has 2 cores. On GPUs (``MAXIMUS_TEST_RANKS=cuda``,
NCCL) the first launch has as many ranks as the host has GPUs, up to 4 (2 on a 2-GPU host).
"""
from pathlib import Path

import pytest
import torch

from tests.distributed.ranks import launch, on_gpus

WORKER = Path(__file__).parent / "ds_worker.py"
STEPS, SAVE_AT = 20, 10
VOCAB, DIM, STATES = 384, 32, 2  # tiny_llama's table; AdamW keeps two state tensors per row

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
BIG = min(4, torch.cuda.device_count()) if on_gpus() else 4  # ranks of the first launch (it saves the checkpoint)


def one_rank(stage: int):
    from tests.engine.llama_utils import build, embedding_weight, maximus_section
    from tests.helpers.models import train, zipf_batches
    e = build(stage, "fp32", micro=4, clip=0.5, maximus=maximus_section(cache_rows=96))
    losses = train(e, zipf_batches(STEPS, batch=4, seqlen=16))
    return {"losses": losses, "embedding": embedding_weight(e)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shard_modes")
    launch(BIG, WORKER, "--out", tmp / "four.pt", "--modes", "partitioned", "--stage", 0, "--steps", STEPS,
           "--save-at", SAVE_AT, "--ckpt", tmp / "ckpt")
    log = launch(2, WORKER, "--out", tmp / "two.pt", "--modes", "partitioned,broadcast,replicated", "--stage", 2,
                 "--steps", STEPS, "--save-at", SAVE_AT, "--resume", tmp / "ckpt", "--resume-stage", 0)
    return {"four": torch.load(tmp / "four.pt", weights_only=False),
            "two": torch.load(tmp / "two.pt", weights_only=False), "log": log, "ckpt": tmp / "ckpt",
            "ref2": one_rank(2), "ref0": one_rank(0)}


def close(got, ref, start=0):
    """Losses rtol 1e-5; weights as in tests/engine/test_zero_equality.py: 99.5% of elements within 1e-5 and
    all within 1e-2 (Adam's 1/sqrt(v) amplifies last-bit differences of summation order where a row's
    gradient nearly cancels; ranks sum a row's gradient in another order than one rank does)."""
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"][start:]), rtol=1e-5, atol=1e-6)
    diff = (got["embedding"] - ref["embedding"]).abs()
    assert float((diff > 1e-5).float().mean()) < 5e-3, float((diff > 1e-5).float().mean())
    assert float(diff.max()) < 1e-2, float(diff.max())


@pytest.mark.parametrize("mode", ["partitioned", "broadcast", "replicated"])
def test_two_ranks_equal_one(runs, mode):
    got = runs["two"][mode]
    assert got["steps"] == STEPS
    close(got, runs["ref2"])


def test_four_ranks_equal_one(runs):
    """(``BIG`` ranks: 4, or the GPUs of a smaller GPU host)"""
    close(runs["four"]["partitioned"], runs["ref0"])


def test_partitioned_tier_is_one_nth(runs):
    full = VOCAB * DIM * 4 * (1 + STATES)
    for key, world in (("two", 2), ("four", BIG)):
        sizes = runs[key]["partitioned"]["tier_bytes"]
        assert sizes == [full / world] * world, (key, sizes, full)


def test_partitioned_stats_count_traffic(runs):
    st = runs["two"]["partitioned"]["stats"]
    assert st["bytes_sent"] > 0 and st["bytes_recv"] > 0 and st["comm_ms"] > 0
    assert st["last_step"]["bytes_sent"] > 0 and st["last_step"]["collectives"] >= 5


def test_checkpoint_of_four_ranks_resumes_on_two(runs):
    files = sorted(p.name for p in (runs["ckpt"] / f"step{SAVE_AT}").glob("maximus_states_rank*.pt"))
    assert files == [f"maximus_states_rank{r:05d}.pt" for r in range(BIG)]
    got = runs["two"]["resume"]
    assert got["start"] == SAVE_AT and got["steps"] == STEPS
    close(got, runs["ref0"], start=SAVE_AT)
