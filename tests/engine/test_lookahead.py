"""With ``training_data=``, the engine's loader runs one batch ahead and prefetches the next rows."""
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
