"""HF's ``run_clm.py`` flow with maximus: ``ds_maximus.enable()``, then ``Trainer(model=<tied Llama>,
args=TrainingArguments(deepspeed=<ds_config dict>))``, train, ``trainer.save_model()``; plain transformers in a
process without ds_maximus reloads the folder to the trained model's logits. The maximus figures are in the
Trainer's logs, and no stats line is printed into its progress bars."""
import json
import subprocess
import sys

import pytest
import torch

import ds_maximus
from tests.distributed.ranks import clean_env
from tests.helpers.models import LLAMA_VOCAB as VOCAB
from tests.helpers.models import tiny_llama, zipf_batches

RELOAD = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM
folder, ids_path, out_path = sys.argv[1:4]
model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, torch_dtype=torch.float32)
assert "ds_maximus" not in sys.modules
ids = torch.load(ids_path)
with torch.no_grad():
    logits = model.eval()(input_ids=ids).logits
torch.save(logits, out_path)
print(json.dumps({k: sorted(v) if isinstance(v, (list, set)) else str(v) for k, v in info.items()}))
print(json.dumps({"tied": bool(model.config.tie_word_embeddings),
                  "same_storage": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()}))
"""


def _ds_config():
    """What run_clm.py users pass: "auto" values filled in by the Trainer, plus a maximus section whose row
    cache (64 rows of 384) is small enough that rows are evicted and fetched back during training."""
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        "steps_per_print": 10**9,
        "maximus": {"embedding": {"min_rows": VOCAB, "gpu_cache_rows": 64}, "logging": {"interval_steps": 1}},
    }


@pytest.fixture
def enabled():
    from ds_maximus.engine.initialize import disable
    ds_maximus.enable()
    yield
    disable()
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    unset_hf_deepspeed_config()
    from accelerate.state import AcceleratorState, PartialState
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def test_collator_wrapper_reads_through_and_pickles_without_the_model():
    """The collator ``enable()`` puts around a Trainer's: the wrapped collator's attributes read through it, and a
    copy for a spawned DataLoader worker carries no model (it cannot prefetch there, and a model may not pickle)."""
    import pickle

    from tokenizers import Tokenizer, models
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    from ds_maximus.integrations.hf import MaximusDataCollator
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<pad>": 1}, unk_token="a")),
                                  pad_token="<pad>")
    wrapped = MaximusDataCollator(DataCollatorForLanguageModeling(tok, mlm=False), tiny_llama(0))
    assert wrapped.mlm is False and wrapped.tokenizer is tok and wrapped.return_tensors == "pt"
    copy = pickle.loads(pickle.dumps(wrapped))
    assert copy._source is None and copy.mlm is False
    assert copy([{"input_ids": [0, 0]}])["input_ids"].tolist() == [[0, 0]]


def test_trainer_tied_llama_save_model_reloads_plain(tmp_path, capfd, enabled):
    from transformers import Trainer, TrainingArguments
    model = tiny_llama(0, tie=True)
    data = [{"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
            for ids in zipf_batches(1, 8, 16, seed=3)[0]]  # 8 sequences of 16 tokens
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=4, per_device_train_batch_size=2,
                             learning_rate=1e-2, weight_decay=0.01, logging_steps=1, save_strategy="no",
                             report_to=[], deepspeed=_ds_config(), use_cpu=True, dataloader_num_workers=0,
                             disable_tqdm=False, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    engine = trainer.model_wrapped
    assert engine.maximus.steps == 4 and result.training_loss == result.training_loss
    assert engine.module.model.embed_tokens.__class__.__name__ in ("ShardedEmbedding",)
    # enable() wrapped the Trainer's collator: every batch after the first was prefetched while the one before
    # trained (accelerate's loader collates one batch ahead), the wrapped collator's attributes read through
    from ds_maximus.integrations.hf import MaximusDataCollator
    assert isinstance(trainer.data_collator, MaximusDataCollator) and trainer.data_collator.prefetches >= 3
    from transformers import default_data_collator
    assert trainer.data_collator.base is default_data_collator

    # the figures went through the Trainer's logging, the engine printed no line of its own
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 4
    assert all(0.0 <= h["maximus/embed_tokens/hit_rate"] <= 1.0 for h in logged)
    assert logged[-1]["maximus/embed_tokens/bytes_h2d"] > 0  # rows came back into the small cache
    out = "".join(capfd.readouterr())
    assert "maximus step=" not in out
    assert "maximus/embed_tokens/hit_rate" in out  # in the Trainer's printed log dicts

    folder = tmp_path / "saved"
    trainer.save_model(str(folder))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = engine.module.eval()(input_ids=ids).logits.float()
    torch.save(ids, tmp_path / "ids.pt")
    env = clean_env()  # the reloading process imports transformers only (it checks ds_maximus is not loaded)
    res = subprocess.run([sys.executable, "-c", RELOAD, str(folder), str(tmp_path / "ids.pt"),
                          str(tmp_path / "logits.pt")], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    info, tied = (json.loads(ln) for ln in res.stdout.splitlines()[-2:])
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [], info
    assert tied == {"tied": True, "same_storage": True}
    got = torch.load(tmp_path / "logits.pt")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # and training moved the model: the reloaded logits are not the initial model's
    with torch.no_grad():
        initial = tiny_llama(0, tie=True).eval()(input_ids=ids).logits
    assert (got - initial).abs().max() > 1e-3
