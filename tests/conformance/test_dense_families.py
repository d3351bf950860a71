"""Dense HF families: maximus computes what the plain model computes, trains like plain DeepSpeed, and saves
folders plain transformers reloads.

Per family (``families.py``: Llama tied and untied, Gemma-2, Gemma-3, Qwen2/Qwen3 tied, Mistral, Phi-3, GPT-2,
GPT-NeoX, OPT, BERT/RoBERTa/XLM-R/DeBERTa-v2 MLM, T5 tied, mT5 untied), on CPU in fp32:

* (a) forward at init: the maximus engine's logits and loss equal the plain engine's (1e-5);
* (b) ``STEPS`` AdamW steps under ``ds_maximus.initialize`` give the losses of plain ``deepspeed.initialize``
  (rtol 1e-4), ZeRO-0 and ZeRO-3, with a row cache of ``CACHE_ROWS`` < the rows the batches touch (rows
  are evicted and come back, exact sparse AdamW replaying their skipped steps);
* (c) after training, ``model.save_pretrained`` and ``ds_maximus.export_hf`` write folders that a python
  process without ds_maximus reloads (``from_pretrained``, no missing or unexpected keys, tied models
  still tied) to the maximus model's logits. All folders reload in one process (the last test).
"""
import copy

import pytest
import torch

from tests.conformance.families import FAMILIES, VOCAB
from tests.conformance.helpers import ds_config, load_in_fresh_process, maximus_section, zipf_ids
from tests.helpers.models import initialize, train

STEPS = 4
CACHE_ROWS = 32
_SAVED: dict = {}   # family -> the folders written by (c) and the logits they must reload to


def _batches(family):
    return [family.batch(ids) for ids in zipf_ids(STEPS, batch=2, seqlen=16, vocab=VOCAB)]


def _engines(family, stage):
    torch.manual_seed(0)
    model = family.build()
    twin = copy.deepcopy(model)
    plain = initialize(model, ds_config(stage))
    ours = initialize(twin, ds_config(stage, maximus_section(family.modules, CACHE_ROWS)))
    return plain, ours


def _forward(engine, batch):
    with torch.no_grad():
        out = engine(**batch)
    return out.logits.float(), out.loss.float()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_forward_training_and_save(name, tmp_path_factory):
    family = FAMILIES[name]
    batches = _batches(family)
    plain, ours = _engines(family, 0)
    # (a) the swap changes nothing the model computes
    ref_logits, ref_loss = _forward(plain, batches[0])
    got_logits, got_loss = _forward(ours, batches[0])
    torch.testing.assert_close(got_logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_loss, ref_loss, rtol=1e-5, atol=1e-5)
    # (b) training equals plain DeepSpeed, rows evicted on the way
    ref = train(plain, batches)
    got = train(ours, batches)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-6)
    emb = dict(ours.module.named_modules())[family.modules[0]]
    assert emb.stats()["rows_evicted"] > 0, "the row cache held every row: the test would not see evictions"
    ref_logits, _ = _forward(plain, batches[0])
    got_logits, _ = _forward(ours, batches[0])
    torch.testing.assert_close(got_logits, ref_logits, rtol=1e-4, atol=1e-4)
    # (c) saved through HF and exported: reloaded in another process below
    import ds_maximus
    root = tmp_path_factory.mktemp(name)
    ours.module.save_pretrained(root / "save_pretrained")
    ds_maximus.export_hf(ours, str(root / "export_hf"))
    _SAVED[name] = {"dirs": [str(root / "save_pretrained"), str(root / "export_hf")], "batch": batches[0],
                    "logits": got_logits, "auto": family.auto,
                    "tie": getattr(ours.module.config, "tie_word_embeddings", None)}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_zero3_training(name):
    family = FAMILIES[name]
    batches = _batches(family)
    plain, ours = _engines(family, 3)
    ref = train(plain, batches)
    got = train(ours, batches)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-6)


def test_saved_folders_reload_without_ds_maximus(tmp_path):
    if not _SAVED:
        pytest.skip("no family ran test_forward_training_and_save in this session")
    jobs = {f"{name}|{d}": {"dir": d, "auto": s["auto"], "kwargs": s["batch"],
                            "load_kwargs": dict(FAMILIES[name].reload)}
            for name, s in _SAVED.items() for d in s["dirs"]}
    out = load_in_fresh_process(tmp_path, jobs)
    for key, job in jobs.items():
        name = key.split("|")[0]
        got = out[key]
        assert not got["info"]["missing_keys"] and not got["info"]["unexpected_keys"], (key, got["info"])
        assert got["tie"] == _SAVED[name]["tie"], f"{key}: tie_word_embeddings {got['tie']}"
        torch.testing.assert_close(got["logits"].float(), _SAVED[name]["logits"], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{key}: {m}")
