"""PartitionedEmbedding over 2 ranks (no DeepSpeed engine): equal to one ShardedEmbedding, 1/N memory,
clear errors for bad ids, and a dead or stalled rank makes the others fail (not hang). Gloo CPU ranks here;
2 GPUs with NCCL under ``MAXIMUS_TEST_RANKS=cuda`` (``scripts/gpu/distributed.sh``)."""
from pathlib import Path

import pytest
import torch

from ds_maximus.distributed import RowPartition
from tests.distributed.ranks import on_gpus, run_ranks

WORKER = Path(__file__).parent / "rank_worker.py"


def test_partition_covers_every_row_once():
    for rows, world, block in [(10, 3, 2), (384, 4, None), (7, 2, 100), (1000, 3, 7)]:
        p = RowPartition(rows, world, block)
        ids = torch.cat([p.global_ids(r) for r in range(world)])
        assert torch.equal(torch.sort(ids).values, torch.arange(rows))
        for r in range(world):
            g = p.global_ids(r)
            assert bool((p.owner(g) == r).all())
            assert torch.equal(p.to_local(g), torch.arange(g.numel()))


def test_hot_rows_spread_over_ranks():
    """Frequency-ordered vocabulary: the hottest 1/8 of the ids is split evenly, not all on rank 0."""
    p = RowPartition(32768, 4)
    head = torch.arange(32768 // 8)
    counts = torch.bincount(p.owner(head), minlength=4)
    assert int(counts.max() - counts.min()) <= p.block_rows


def reference(world: int, tied_grad: bool = False):
    """One plain ``ShardedEmbedding`` trained on the whole global batches of ``world`` ranks (rank_worker's)."""
    from ds_maximus.config import EmbeddingConfig
    from ds_maximus.vocab import ShardedEmbedding
    from tests.distributed import rank_worker as rw
    torch.manual_seed(0)
    w = torch.randn(rw.VOCAB, rw.DIM)
    dev = torch.device("cuda", 0) if on_gpus() else torch.device("cpu")  # one GPU against two, or one CPU rank
    ref = ShardedEmbedding(rw.VOCAB, rw.DIM, padding_idx=1, _weight=w, device=dev,
                           config=EmbeddingConfig(gpu_cache_rows=16, optimizer={"lr": 0.05, "weight_decay": 0.1}))
    losses = []
    for ids in rw.batches(world):
        loss = (ref(ids.to(dev)) * torch.linspace(-1, 1, rw.DIM, device=dev)).pow(2).mean()
        loss.backward()
        if tied_grad:
            ref.grad.add(torch.arange(4, 8), torch.full((4, rw.DIM), 0.01, device=dev))
        ref.sparse_step()
        losses.append(float(loss.detach()))
    return ref, losses


@pytest.mark.distributed
def test_two_ranks_equal_one_and_bad_ids_fail_everywhere(tmp_path):
    from tests.distributed import rank_worker as rw
    rcs, outs, _ = run_ranks(2, WORKER, "equal,bad_id", tmp_path / "r.pt")
    # bad_id: an id no rank holds fails on every rank with a clear error (no hang), after "equal" ran
    assert rcs == [3, 3], "\n".join(outs)
    assert "bad_id DistributedError" in outs[0] and "rank(s) [1] looked up token ids outside the table" in outs[0]
    assert f"token id {rw.VOCAB + 7} on rank 1 is outside the table" in outs[1]
    assert outs[0].count("RANK0 ") == 1, outs[0]
    got = torch.load(tmp_path / "r.pt", weights_only=False)
    assert (got["backend"], got["device"]) == (("nccl", "cuda:0") if on_gpus() else ("gloo", "cpu"))

    ref, losses = reference(2)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got["weight"], ref.full_weight(), rtol=1e-5, atol=1e-6)
    # each rank holds half of the table's bytes (weight + 2 Adam states + cache), not the whole
    full = rw.VOCAB * rw.DIM * 4 * 3
    assert got["table_bytes"] < 0.5 * full + 16 * rw.DIM * 4 * 3 + rw.VOCAB * 8, (got["table_bytes"], full)
    assert got["stats"]["bytes_sent"] > 0 and got["stats"]["comm_ms"] > 0


@pytest.mark.distributed
def test_dead_rank_fails_the_others(tmp_path):
    rcs, outs, secs = run_ranks(2, WORKER, "die", tmp_path / "x", timeout=90)
    assert rcs == [3, 7], "\n".join(outs)
    assert "die DistributedError: maximus collective 'row grads to owners' (step 0, rank 0 of 2)" in outs[0], outs[0]
    assert secs < 60


@pytest.mark.distributed
def test_stalled_rank_times_out_naming_the_collective(tmp_path):
    rcs, outs, secs = run_ranks(2, WORKER, "hang", tmp_path / "x", timeout=90)
    assert rcs[0] == 3, "\n".join(outs)
    assert "maximus collective 'row grads to owners' (step 0, rank 0 of 2) timed out after 3 s" in outs[0], outs[0]


@pytest.mark.distributed
def test_one_rank_takes_the_plain_path_without_collectives(tmp_path):
    """A partitioned table on one rank is the plain ShardedEmbedding: no torch.distributed call after it is built
    (lookups, backward, prefetch, a tied head's gradient and rows, the whole table), results bit-equal."""
    rcs, outs, _ = run_ranks(1, WORKER, "single", tmp_path / "s.pt")
    assert rcs == [0], "\n".join(outs)
    got = torch.load(tmp_path / "s.pt", weights_only=False)
    assert got["called"] == got["built"] == [], got["called"]  # not even the partition agreement check
    st = got["stats"]
    assert st["collectives"] == 0 and st["bytes_sent"] == 0 and st["comm_ms"] == 0.0
    assert st["last_step"]["collectives"] == 0 and st["prefetches"] == 6
    assert st["owner_rows_asked"] == st["lookups"] > 0 and st["owner_hit_rate"] == st["hit_rate"]
    ref, losses = reference(1, tied_grad=True)
    # bit-equal on CPU; on a GPU the prefetched rows' catch-up runs on the fill stream (same kernel, other order)
    tol = {"rtol": 1e-6, "atol": 1e-7} if on_gpus() else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), **tol)
    torch.testing.assert_close(got["weight"], ref.full_weight().cpu(), **tol)
    torch.testing.assert_close(got["rows"], ref.rows_for_compute(0, 8, "cpu"), **tol)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["partitioned", "broadcast"])
def test_weight_reads_rows_from_their_owners(tmp_path, mode):
    """``.weight`` of a table cut over 2 ranks, or held by a master (Llama-4 reads its device, Gemma-4 multimodal its
    pad row): metadata
    with no collective; rows read from their owners; the whole table by any other use; and a loss through the pad
    row read as a weight sends that row its gradient (a lookup's would not), so the step equals one ShardedEmbedding
    trained on both ranks' losses."""
    from ds_maximus.config import EmbeddingConfig
    from ds_maximus.vocab import ShardedEmbedding
    from tests.distributed import rank_worker as rw
    rcs, outs, _ = run_ranks(2, WORKER, "weight_view" if mode == "partitioned" else "weight_view_broadcast",
                             tmp_path / "w.pt")
    assert rcs == [0, 0], "\n".join(outs)
    got = torch.load(tmp_path / "w.pt", weights_only=False)
    dev = "cuda:0" if on_gpus() else "cpu"
    assert got["meta"] == ((rw.VOCAB, rw.DIM), torch.float32, dev, True, rw.VOCAB) and got["meta_calls"] == 0
    w = got["w"]
    assert torch.equal(got["rows"], w[got["mine"]]) and torch.equal(got["row"], w[-1])
    assert torch.equal(got["whole"], w)
    ref = ShardedEmbedding(rw.VOCAB, rw.DIM, padding_idx=1, _weight=w,
                           config=EmbeddingConfig(gpu_cache_rows=16, optimizer={"lr": 0.05, "weight_decay": 0.1}))
    ref.train_padding_row()
    x = torch.linspace(-1, 1, rw.DIM)
    ids = rw.batches(2)[0]
    # DeepSpeed averages the ranks' gradients: the mean of the two ranks' losses
    loss = sum((ref(ids[r * 2:(r + 1) * 2]) * x).pow(2).mean() + (ref.weight[1, :] * x * (r + 1)).sum()
               for r in range(2)) / 2
    loss.backward()
    ref.sparse_step()
    torch.testing.assert_close(got["after"], ref.full_weight(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama4", "gemma4_multimodal"])
def test_families_reading_the_weight_train_with_the_table_cut_over_ranks(tmp_path, name):
    """Llama-4 reads ``embed_tokens.weight.device`` and Gemma-4 multimodal ``embed_tokens.weight[pad_id, :]`` in
    every forward: under the ``deepspeed`` launcher on 2 ranks with ``shard_mode: partitioned`` they train as plain
    DeepSpeed does on one rank with the same global batch."""
    from tests.conformance.families import FAMILIES
    from tests.conformance.helpers import ds_config
    from tests.distributed import family_worker as fw
    from tests.distributed.ranks import launch
    from tests.helpers.models import train
    launch(2, Path(fw.__file__), "--out", tmp_path / "f.pt", "--family", name, "--mode", "partitioned")
    got = torch.load(tmp_path / "f.pt", weights_only=False)
    import deepspeed
    family = FAMILIES[name]
    torch.manual_seed(0)
    model = family.build()
    plain, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                     config=ds_config(2, micro=fw.GLOBAL_BATCH))
    want = train(plain, fw.batches(family))
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want), rtol=1e-4, atol=1e-6)
