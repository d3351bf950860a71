"""maximus figures reach DeepSpeed's csv_monitor with hand-checkable values; the log line keeps its interval."""
import csv

import pytest
import torch

import ds_maximus
from tests.engine.llama_utils import maximus_section
from tests.helpers.models import ds_config, tiny_llama

D = 32  # hidden size of tests.engine.llama_utils.tiny_llama


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


def _engine(interval):
    sec = maximus_section(cache_rows=384)
    sec["logging"] = {"interval_steps": interval}
    model = tiny_llama(0)
    e, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(),
                                  config=ds_config(0, "fp32", maximus=sec, lr=1e-3))
    return e


def _steps(e, n):
    ids = torch.arange(8).repeat(2, 1)
    for _ in range(n):
        e.backward(e(input_ids=ids, labels=ids).loss)
        e.step()


def _stat_lines(capsys):
    return [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("maximus step=")]


def test_stats_line_names_the_global_step_once(capsys):
    """The line's step is the engine's global step; the end-of-run line is not printed again for a step the
    interval already printed (the quick start printed ``step=30`` twice)."""
    from ds_maximus.observability import log_stats
    e = _engine(2)
    _steps(e, 4)
    log_stats(e.maximus, final=True)  # step 4 was printed by the interval
    assert [ln.split()[1] for ln in _stat_lines(capsys)] == ["step=2", "step=4"]
    assert e.global_steps == 4 and ds_maximus.stats(e).global_step == 4
    _steps(e, 1)
    log_stats(e.maximus, final=True)
    log_stats(e.maximus, final=True)
    assert [ln.split()[1] for ln in _stat_lines(capsys)] == ["step=5"]


def test_trainer_callback_puts_the_figures_in_the_logs(capsys):
    """MaximusTrainerCallback adds the stats line's figures to the Trainer's logs and its log history, and
    the engine stops printing its own line (no raw prints inside tqdm bars)."""
    from transformers import TrainerControl, TrainerState

    from ds_maximus.integrations.trainer_callback import MaximusTrainerCallback
    from ds_maximus.observability import format_line
    e = _engine(1)
    cb, state, control = MaximusTrainerCallback(), TrainerState(), TrainerControl()
    cb.on_train_begin(None, state, control, model=e.module)
    _steps(e, 2)
    assert _stat_lines(capsys) == []
    state.global_step = 2
    state.log_history.append({"loss": 1.5, "step": 2})
    logs = {"loss": 1.5}
    cb.on_log(None, state, control, logs=logs, model=e.module)
    s = ds_maximus.stats(e)
    st = s.modules["model.embed_tokens"]
    assert logs["loss"] == 1.5
    assert logs["maximus/embed_tokens/hit_rate"] == pytest.approx(st["hit_rate"], abs=1e-4)
    assert logs["maximus/embed_tokens/row_sparsity"] == pytest.approx(st["row_sparsity"], abs=1e-4)
    assert logs["maximus/embed_tokens/bytes_h2d"] == int(st["bytes_h2d"])
    assert state.log_history[-1]["maximus/embed_tokens/hit_rate"] == logs["maximus/embed_tokens/hit_rate"]
    assert format_line(s).startswith("maximus step=2 embed_tokens[hit_rate=")
    # a model no maximus engine drives is left alone
    other = {"loss": 2.0}
    cb.on_log(None, state, control, logs=other, model=tiny_llama(1))
    assert other == {"loss": 2.0}


def test_enable_adds_the_callback_to_every_trainer():
    from transformers import trainer

    from ds_maximus.engine.initialize import disable, enable
    from ds_maximus.integrations.trainer_callback import MaximusTrainerCallback
    enable()
    try:
        enable()
        assert trainer.DEFAULT_CALLBACKS.count(MaximusTrainerCallback) == 1
    finally:
        disable()
    assert MaximusTrainerCallback not in trainer.DEFAULT_CALLBACKS
