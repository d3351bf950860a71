"""HF Trainer (``run_clm.py``'s flow: ``TrainingArguments(deepspeed=cfg)`` after ``ds_maximus.enable()``) trains
a tied Llama with ``lm_head.enabled``, ``trainer.save_model()`` writes a folder, and plain transformers in a
process without ds_maximus reloads it tied, with no missing or unexpected keys, to the trained logits.

ZeRO-0 saves ``model.state_dict()``; ZeRO-3 saves DeepSpeed's consolidated state dict
(``stage3_gather_16bit_weights_on_model_save``), which maximus completes with its sharded tables.
"""
import pytest
import torch

from tests.conformance.families import FAMILIES, VOCAB
from tests.conformance.helpers import load_in_fresh_process, zipf_ids


@pytest.mark.parametrize("stage", [0, 3])
def test_trainer_save_model_reloads_tied(stage, tmp_path):
    from transformers import Trainer, TrainingArguments

    import ds_maximus
    from ds_maximus.engine.initialize import disable
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": zero, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        "maximus": {"embedding": {"modules": ["model.embed_tokens"], "gpu_cache_rows": 32},
                    "lm_head": {"enabled": True, "chunk_rows": 96}},
    }
    torch.manual_seed(0)
    model = FAMILIES["llama_tied"].build()
    data = [{"input_ids": ids[0], "labels": ids[0].clone()} for ids in zipf_ids(8, 1, 16, VOCAB)]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=2,
                             learning_rate=1e-2, weight_decay=0.1, save_strategy="no", report_to=[],
                             deepspeed=ds_config, use_cpu=True, dataloader_num_workers=0, logging_steps=1)
    ds_maximus.enable()
    try:
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        assert trainer.model_wrapped.maximus.steps == 3
        trainer.save_model(str(tmp_path / "saved"))
        ids = zipf_ids(1, 2, 16, VOCAB, seed=5)[0]
        with torch.no_grad():
            want = trainer.model_wrapped(input_ids=ids).logits.float()
    finally:
        disable()
    out = load_in_fresh_process(tmp_path, {"m": {"dir": str(tmp_path / "saved"), "kwargs": {"input_ids": ids}}})["m"]
    assert out["tie"] is True
    assert not out["info"]["missing_keys"] and not out["info"]["unexpected_keys"], out["info"]
    torch.testing.assert_close(out["logits"].float(), want, rtol=1e-5, atol=1e-5)


def test_trainer_evaluate_with_and_without_compute_metrics(tmp_path):
    """``run_clm.py --do_eval``: its ``preprocess_logits_for_metrics`` reads the logits, which a streamed head did
    not return (an IndexError inside the Trainer). Now an evaluation with ``compute_metrics`` gets the plain model's
    logits and loss, and one without streams its loss (no logits), both equal to plain DeepSpeed's; a script's own
    evaluation call under ``torch.no_grad`` streams too (``eval_logits: auto``)."""
    from transformers import Trainer, TrainingArguments

    import ds_maximus
    from ds_maximus.engine.initialize import disable
    from ds_maximus.integrations import hf_lm_head

    def config(maximus):
        cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
               "zero_optimization": {"stage": 0}, "steps_per_print": 10**9,
               "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}}}
        if maximus:
            cfg["maximus"] = {"embedding": {"modules": ["model.embed_tokens"], "gpu_cache_rows": 32},
                              "lm_head": {"enabled": True, "chunk_rows": 96}}
        return cfg

    def pre(logits, labels):
        return (logits[0] if isinstance(logits, tuple) else logits).argmax(-1)

    def accuracy(p):
        preds, labels = p
        return {"acc": float((preds[:, :-1] == labels[:, 1:]).mean())}

    data = [{"input_ids": ids[0], "labels": ids[0].clone()} for ids in zipf_ids(8, 1, 16, VOCAB)]
    streamed = []
    loss = hf_lm_head._Patch.loss

    def counting(self, *a, **kw):
        streamed.append(1)
        return loss(self, *a, **kw)

    results = {}
    ds_maximus.enable()
    try:
        hf_lm_head._Patch.loss = counting
        for maximus in (False, True):
            torch.manual_seed(0)
            model = FAMILIES["llama_tied"].build()
            args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=2,
                                     per_device_eval_batch_size=4, learning_rate=1e-2, save_strategy="no",
                                     report_to=[], deepspeed=config(maximus), use_cpu=True,
                                     dataloader_num_workers=0)
            trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data,
                              compute_metrics=accuracy, preprocess_logits_for_metrics=pre)
            trainer.train()
            before = len(streamed)
            with_metrics = trainer.evaluate()
            assert len(streamed) == before, "an evaluation that reads the logits streamed its loss"
            trainer.compute_metrics = trainer.preprocess_logits_for_metrics = None
            loss_only = trainer.evaluate()
            assert len(streamed) == before + (2 if maximus else 0), "a loss-only evaluation did not stream"
            results[maximus] = (with_metrics["eval_loss"], with_metrics["eval_acc"], loss_only["eval_loss"])
            if maximus:   # outside the Trainer's evaluation: the streamed loss, no logits (the memory bound kept)
                ids = data[0]["input_ids"][None]
                with torch.no_grad():
                    assert trainer.model_wrapped(input_ids=ids, labels=ids).logits is None
    finally:
        hf_lm_head._Patch.loss = loss
        disable()
    torch.testing.assert_close(torch.tensor(results[True]), torch.tensor(results[False]), rtol=1e-5, atol=1e-6)
