"""Ranks of one host share its cores: each gets cores / local ranks intra-op threads, unless OMP_NUM_THREADS
is set (ds_maximus/distributed/cores.py)."""
import torch

from ds_maximus.distributed.cores import host_cores, share_host_cores


def test_ranks_split_the_cores(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    try:
        monkeypatch.setenv("LOCAL_SIZE", "1")
        assert share_host_cores() is None and torch.get_num_threads() == before  # one rank: all cores
        monkeypatch.setenv("LOCAL_SIZE", "2")  # the deepspeed launcher's name
        n = share_host_cores()
        assert n == max(1, host_cores() // 2)
        assert torch.get_num_threads() == min(before, n)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * host_cores()))  # torchrun's name wins; at least 1
        assert share_host_cores() == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice wins
        torch.set_num_threads(2)
        assert share_host_cores() is None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
