"""DeepSpeed's CPU allreduce buffer in /dev/shm is removed when the process that created it exits; other
processes' buffers are left alone."""
import json
import os
import subprocess
import sys

import pytest

from ds_maximus.distributed import shm_buffers
from tests.distributed.ranks import ROOT, clean_env, free_port

CHILD = r"""
import json, os, sys
import torch
import ds_maximus
from ds_maximus.distributed import shm_buffers
model = torch.nn.Linear(4, 4)
cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
engine, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=cfg)
own = shm_buffers.own_buffers()
print(json.dumps({"own": own, "exists": [os.path.exists(os.path.join("/dev/shm", n)) for n in own],
                  "mapped": shm_buffers.mapped_buffers()}), flush=True)
torch.distributed.destroy_process_group()
"""


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.path.exists("/proc/self/maps"),
                    reason="needs Linux /dev/shm and /proc")
def test_own_allreduce_buffer_removed_at_exit():
    port = free_port()
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0"
    env = clean_env()
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    res = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads([ln for ln in res.stdout.splitlines() if ln.startswith("{")][-1])
    if not got["mapped"]:
        pytest.skip("DeepSpeed's CPU shm allreduce op is not in use on this machine")
    assert got["own"] == [name]
    if got["exists"] != [True]:  # a concurrent test session's clean-up (tests/conftest.py) removed it first
        pytest.skip(f"{name} was removed by another process while the child ran")
    assert not os.path.exists(os.path.join("/dev/shm", name))  # removed at the child's exit


def test_only_this_ranks_mapped_buffer_is_its_own(tmp_path):
    """Rank 1 maps its own buffer and rank 0's (DeepSpeed maps every local rank's); only its own is its to
    remove, and a buffer it does not map (another run's) is not considered at all."""
    uid = os.getuid()
    own = f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_29512_1"
    peer = f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_29512_0"
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0000000000-7f0004200000 rw-s 00000000 00:1a 101    /dev/shm/" + peer + "\n"
        "7f0004200000-7f0008400000 rw-s 00000000 00:1a 102    /dev/shm/" + own + " (deleted)\n"
        "7f0008400000-7f0008401000 r--p 00000000 08:01 103    /usr/lib/libc.so.6\n"
        "7f0008401000-7f0008402000 rw-p 00000000 00:00 0 \n"
        f"7f0008402000-7f0008403000 rw-s 00000000 00:1a 104    /dev/shm/deepspeed_allreduce_buffer_{uid + 1}_x_1_1\n")
    assert shm_buffers.mapped_buffers(str(maps)) == sorted([own, peer])
    assert shm_buffers.own_buffers(rank=1, maps_path=str(maps)) == [own]
    assert shm_buffers.own_buffers(rank=0, maps_path=str(maps)) == [peer]
    assert shm_buffers.own_buffers(rank=2, maps_path=str(maps)) == []
