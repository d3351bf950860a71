"""The broadcast shard mode (no DeepSpeed engine): the master holds the table, the other ranks none of it; 2 ranks
train equal to one plain table, through a checkpoint round trip on the master. The engine-level runs (ZeRO stages,
tied heads, accumulation, checkpoints across rank counts) are in ``test_combinations.py``."""
from pathlib import Path

import pytest
import torch

from ds_maximus.distributed.partition import MasterPartition
from tests.distributed.ranks import run_ranks
from tests.distributed.test_partitioned_embedding import reference

WORKER = Path(__file__).parent / "rank_worker.py"


def test_master_partition_gives_every_row_to_the_master():
    p = MasterPartition(10, world=3, master=2)
    ids = torch.tensor([0, 4, 9])
    assert p.owner(ids).tolist() == [2, 2, 2] and torch.equal(p.to_local(ids), ids)
    assert torch.equal(p.global_ids(2), torch.arange(10)) and p.global_ids(0).numel() == 0
    assert [p.num_local(r) for r in range(3)] == [0, 0, 10]
    with pytest.raises(ValueError):
        MasterPartition(10, world=2, master=2)


@pytest.mark.distributed
def test_two_ranks_equal_one_through_a_checkpoint_and_only_the_master_holds_the_table(tmp_path):
    from tests.distributed import rank_worker as rw
    rcs, outs, _ = run_ranks(2, WORKER, "broadcast", tmp_path / "b.pt")
    assert rcs == [0, 0], "\n".join(outs)
    got = torch.load(tmp_path / "b.pt", weights_only=False)
    ref, losses = reference(2)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got["weight"], ref.full_weight(), rtol=1e-5, atol=1e-6)
    # the master (rank 1) holds the table: weight + 2 AdamW states in its tier, plus its row cache; rank 0 nothing
    tier = rw.VOCAB * rw.DIM * 4 * 3
    (other_table, other_tier), (master_table, master_tier) = got["held"]
    assert master_tier == tier and master_table > tier, got["held"]
    assert other_table == 0 and other_tier == 0, got["held"]
    # loading: the master read the checkpoint; rank 0 received the table's step counters, not its rows
    assert "tensors" not in got["received"] and got["received"]["optimizer"]["step"] == 3, got["received"]
    assert got["step"] == rw.STEPS
    st = got["stats"]  # rank 0's: it sent ids and gradients to the master and got rows back
    assert st["master"] == 1 and st["bytes_sent"] > 0 and st["bytes_recv"] > 0 and st["comm_ms"] > 0
    assert st["last_step"]["bytes_sent"] > 0 and st["last_step"]["collectives"] >= 4
    # the user's stats line and monitor events carry the collectives (bytes, ms; per step for the monitors)
    from ds_maximus.observability import MaximusStats, format_line, monitor_events
    s = MaximusStats(rw.STEPS, 0, 1.0, {"model.embed_tokens": st})
    line = format_line(s)
    assert f"bytes_sent={st['bytes_sent']:.3g}B" in line and f"comm_ms={st['comm_ms']:.1f}ms" in line, line
    events = {tag: v for tag, v, _ in monitor_events(s, 1)}
    assert events["Maximus/model.embed_tokens/bytes_sent"] == st["last_step"]["bytes_sent"]
    assert events["Maximus/model.embed_tokens/comm_ms"] == st["last_step"]["comm_ms"]
