"""With ``training_data=``, the engine's loader runs one batch ahead and prefetches the next rows."""
import pytest
import torch

import ds_maximus
from ds_maximus.engine.lookahead import LookaheadLoader
from tests.engine.llama_utils import maximus_section
from tests.helpers.models import ds_config, tiny_llama, zipf_batches


def test_training_data_loader_prefetches_next_batch():
    data = [{"input_ids": ids} for ids in torch.cat(zipf_batches(4, batch=2, seqlen=16))]
    model = tiny_llama(0)
    engine, _, loader, _ = ds_maximus.initialize(model=model, model_parameters=model.parameters(),
                                                 training_data=data,
                                                 config=ds_config(2, "fp32", maximus=maximus_section(96)))
    assert isinstance(loader, LookaheadLoader) and len(loader) == 4
    emb = engine.module.model.embed_tokens
    calls = []
    real = emb.prefetch
    emb.prefetch = lambda ids: (calls.append(torch.unique(ids).tolist()), real(ids))[1]
    seen = []
    for batch in loader:
        ids = batch["input_ids"].to(engine.device)
        seen.append(torch.unique(ids).tolist())
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    assert len(seen) == 4
    # batch t+1 was prefetched before batch t was handed out: every batch but the first
    assert calls == seen[1:]
    assert engine.maximus.steps == 4


@pytest.mark.parametrize("rows_on_gpu,user,want", [(True, None, False), (False, None, None), (True, True, True)])
def test_throughput_timer_does_not_wait_for_the_rows_step_on_a_gpu(rows_on_gpu, user, want):
    """On a GPU the step of the rows outside the cache runs on into the next forward; DeepSpeed's throughput timer
    would sync the device at every forward, so initialize turns its sync off there, unless the config sets it."""
    from ds_maximus.config import MaximusConfig
    from ds_maximus.engine.initialize import _unsynchronized_throughput_timer
    cfg = {"train_batch_size": 2}
    if user is not None:
        cfg["timers"] = {"throughput": {"synchronized": user}}
    out = _unsynchronized_throughput_timer(cfg, MaximusConfig(), rows_on_gpu)
    assert out.get("timers", {}).get("throughput", {}).get("synchronized") is want


def _tied_run(defer: bool, monkeypatch):
    """Losses and final table of a tied tiny Llama (lm_head streamed, clipping on) trained 5 steps through the
    look-ahead loader, its table's out-of-cache rows stepped by the staged pipeline (as on a GPU)."""
    from ds_maximus.engine.runtime import first_block
    from ds_maximus.vocab.sharded_embedding import ShardedEmbedding
    monkeypatch.setattr(ShardedEmbedding, "DEFER_TIER_STEPS", defer)
    data = [{"input_ids": ids} for ids in torch.cat(zipf_batches(5, batch=2, seqlen=16))]
    model = tiny_llama(0, tie=True)
    section = {**maximus_section(64), "lm_head": {"enabled": True, "chunk_rows": 100, "reuse_rows": "on"}}
    engine, _, loader, _ = ds_maximus.initialize(model=model, model_parameters=model.parameters(), training_data=data,
                                                 config=ds_config(2, "fp32", clip=1.0, maximus=section))
    emb = engine.module.model.embed_tokens
    emb.staged_tier_update = True
    assert first_block(engine.module) is engine.module.model.layers[0]
    launched = []
    real = emb.launch_deferred_step
    emb.launch_deferred_step = lambda: (launched.append(emb._deferred is not None), real())
    losses = []
    for batch in loader:
        ids = batch["input_ids"].to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    return torch.stack(losses), emb.full_weight(), launched


def test_tied_table_step_deferred_to_the_first_decoder_layer_trains_the_same(monkeypatch):
    """initialize defers a tied table's staged step to the model's first decoder layer (``first_block``): the step is
    prepared at ``engine.step()`` and issued when ``model.layers[0]``'s next forward starts, after the lookup and
    transformers' mask checks. Losses and the table are bit-identical to the step issued at ``engine.step()`` (on a
    GPU, where the worker thread issues real streams and events, within the kernels' own run-to-run order)."""
    loss_on, w_on, launched = _tied_run(True, monkeypatch)
    loss_off, w_off, not_hooked = _tied_run(False, monkeypatch)
    tol = {"rtol": 1e-5, "atol": 1e-6} if torch.cuda.is_available() else {"rtol": 0, "atol": 0}  # GPU kernel order
    torch.testing.assert_close(loss_on, loss_off, **tol)
    torch.testing.assert_close(w_on, w_off, **tol)
    assert sum(launched) >= 3 and not not_hooked   # the layer's pre-hook issued the deferred steps
