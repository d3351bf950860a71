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


def test_lookahead_prefetches_loaders_of_bare_token_id_tensors():
    """A loader of plain ``[B, T]`` id tensors (plain DeepSpeed scripts, the bench) is prefetched one batch ahead like
    a dict loader; a float tensor batch is not token ids and prefetches nothing."""
    from ds_maximus.engine.lookahead import lookahead, unique_ids

    class Rows:
        def __init__(self):
            self.calls = []

        def prefetch(self, ids):
            self.calls.append(ids.tolist())
    batches = [torch.tensor([[3, 1, 3]]), torch.tensor([[2, 2, 5]]), torch.tensor([[7, 0, 7]])]
    m = Rows()
    seen = [b for b in lookahead(batches, [m])]
    assert len(seen) == 3 and m.calls == [[2, 5], [0, 7]]
    assert unique_ids(torch.rand(2, 3)) is None and unique_ids(torch.tensor([4, 4, 1])).tolist() == [1, 4]


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
