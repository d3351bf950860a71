"""Multi-node is DeepSpeed's: the shard modes take their group from DeepSpeed (its data-parallel group, over
whatever hosts the launcher started), so 2 nodes x 2 ranks need nothing of ours. Simulated on one machine by
starting DeepSpeed's per-node launcher once per "node" (what ``deepspeed --hostfile`` runs on each host over
ssh; see ``launch_nodes``): each rank sees the environment of a real 2-node launch, and partitioned (tied head),
broadcast and replicated training equals one rank with the same global batch.
"""
from pathlib import Path

import pytest

from tests.distributed.ranks import launch_nodes
from tests.distributed.test_combinations import BATCH, cfg, close, ref_key, run_refs, write_spec

WORKER = Path(__file__).parent / "combo_worker.py"

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMBOS = [cfg("partitioned_tied_z2", "partitioned", 2, 1, True),
          cfg("broadcast_z1", "broadcast", 1, 1, master_rank=2),  # the master on the second node
          cfg("replicated_gas2_z3", "replicated", 3, 2)]


def test_two_nodes_of_two_ranks_equal_one_rank(tmp_path):
    import torch
    assert BATCH % 4 == 0
    launch_nodes(2, 2, WORKER, "--spec", write_spec(tmp_path, "nodes", COMBOS), "--out", tmp_path / "nodes.pt",
                 timeout=900)
    got = torch.load(tmp_path / "nodes.pt", weights_only=False)
    env = got["_env"]
    assert [e["RANK"] for e in env] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in env] == ["0", "1", "0", "1"]
    assert [e["CROSS_RANK"] for e in env] == ["0", "0", "1", "1"]
    assert {e["LOCAL_SIZE"] for e in env} == {"2"} and {e["WORLD_SIZE"] for e in env} == {"4"}
    assert {e["dp_group_size"] for e in env} == {4}  # DeepSpeed's data-parallel group spans both nodes
    refs = run_refs(COMBOS, tmp_path)
    for c in COMBOS:
        close(got[c["key"]], refs[ref_key(c)])
