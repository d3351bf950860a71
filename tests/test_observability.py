"""maximus figures reach DeepSpeed's csv_monitor with hand-checkable values; the log line keeps its interval."""
import csv

import pytest
import torch

import ds_maximus
from tests.zero.llama_utils import ds_config, maximus_section, tiny_llama

D = 32  # hidden size of tests.zero.llama_utils.tiny_llama


def _series(root, tag):
    files = list(root.rglob(tag.replace("/", "_") + ".csv"))
    assert files, f"no csv for {tag} under {root}: {[p.name for p in root.rglob('*.csv')]}"
    with open(files[0]) as f:
        rows = list(csv.reader(f))
    return [float(r[1]) for r in rows[1:]]


def test_csv_monitor_gets_maximus_series(tmp_path, capsys):
    sec = maximus_section(cache_rows=384)
    sec["logging"] = {"interval_steps": 2}
    cfg = ds_config(2, "fp32", maximus=sec, lr=1e-3)
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path), "job_name": "mx"}
    model = tiny_llama(0)
    e, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ids = torch.arange(8).repeat(2, 1)  # 8 distinct rows, every step
    snapshots = []
    for _ in range(4):
        loss = e(input_ids=ids, labels=ids).loss
        e.backward(loss)
        e.step()
        snapshots.append(ds_maximus.stats(e))
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("maximus step=")]
    assert [ln.split()[1] for ln in lines] == ["step=2", "step=4"]

    name = "model.embed_tokens"
    hit = _series(tmp_path, f"Maximus/{name}/hit_rate")
    sparsity = _series(tmp_path, f"Maximus/{name}/row_sparsity")
    h2d = _series(tmp_path, f"Maximus/{name}/bytes_h2d")
    cum = _series(tmp_path, f"Maximus/{name}/hit_rate_cumulative")
    # written at steps 2 and 4: both steps hit every row (they were fetched at step 1)
    assert hit == [1.0, 1.0]
    assert sparsity == [pytest.approx(8 / 384)] * 2
    assert h2d == [0.0, 0.0]
    assert cum == [pytest.approx(16 / 32), pytest.approx(48 / 64)]
    # the stats API agrees with what the monitor got
    st = snapshots[-1].modules[name]
    assert st["hit_rate"] == pytest.approx(cum[-1])
    assert st["last_step"]["row_sparsity"] == pytest.approx(sparsity[-1])
    # step 1 fetched the 8 rows (weight + 2 AdamW moments, fp32) into the cache
    first = snapshots[0].modules[name]["last_step"]
    assert first["rows_fetched"] == 8 and first["hit_rate"] == 0.0
    assert first["bytes_h2d"] in (8 * D * 4, 8 * D * 4 * 3)
