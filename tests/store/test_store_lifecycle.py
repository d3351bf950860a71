"""Repeated runs on one ``nvme_path`` keep disk use flat, and checkpoints stay loadable across them.

Three fresh runs of a real engine (tiny Llama, CPU DeepSpeed ZeRO-2, the embedding on the NVMe tier) on
one ``nvme_path``: each reuses the store (same layout) and rewrites it, so the file count and bytes stay
what the first run left (before, each run added a whole table: 11 -> 21 -> 31 files). A fourth run with
another layout replaces the store. Files a crashed run left behind are removed at the next open. A
checkpoint saved by the first run still resumes exactly after the store was rewritten and replaced:
checkpoints hold their tables in full, not references to shard files.
"""
import os

import torch

from ds_maximus.store import INDEX_NAME, ShardStore
from tests.engine.llama_utils import build, embedding_weight, maximus_section
from tests.helpers.models import LLAMA_VOCAB as VOCAB
from tests.helpers.models import train, zipf_batches


def _usage(folder):
    names = sorted(os.listdir(folder))
    return len(names), sum(os.path.getsize(os.path.join(folder, n)) for n in names), names


def _run(nvme, rows_per_shard, batches, ckpt=None):
    sec = maximus_section(cache_rows=64, rows_per_shard=rows_per_shard,
                          offload={"device": "nvme", "nvme_path": str(nvme), "cpu_cache_shards": 2})
    e = build(2, "fp32", maximus=sec)
    train(e, batches)
    if ckpt is not None:
        e.save_checkpoint(str(ckpt), tag="t")
    w = embedding_weight(e)
    e.maximus.modules["model.embed_tokens"].flush()
    return e, w


def test_three_runs_keep_disk_flat_and_checkpoints_valid(tmp_path):
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    batches = zipf_batches(3, batch=2, seqlen=16)
    _, w1 = _run(nvme, 64, batches, ckpt=ckpt)
    first = _usage(nvme)
    assert first[0] == VOCAB // 64 + 1  # six shards and the index
    usage = [first[:2]]
    for seed in (1, 2):
        _run(nvme, 64, zipf_batches(3, batch=2, seqlen=16, seed=seed))
        usage.append(_usage(nvme)[:2])
    # the same files; the bytes differ only by the index's access counts (a leaked table would add ~170 KB)
    assert [n for n, _ in usage] == [first[0]] * 3 and max(b for _, b in usage) - first[1] < 100, usage

    # a crashed run's leftovers: a shard file no index names and a dead writer's temp file
    for name in ("shard_000003-0badc0de.safetensors", ".shard_000001-01234567.safetensors.tmp-99999999-ab12cd34"):
        (nvme / name).write_bytes(b"x" * 4096)
    e, _ = _run(nvme, 128, batches)  # another layout: the store is replaced
    n, nbytes, names = _usage(nvme)
    assert n == VOCAB // 128 + 1 and nbytes < first[1], names
    store = ShardStore.open(str(nvme), loader=False)
    assert store.rows_per_shard == 128 and store.verify()["orphans"] == []
    assert set(names) == {INDEX_NAME} | {store.shard_info(i).file for i in range(store.num_shards)}

    path, _ = e.load_checkpoint(str(ckpt), tag="t")  # run 1's checkpoint, after two rewrites and a replacement
    assert path is not None and e.maximus.steps == 3
    assert torch.equal(embedding_weight(e), w1)
