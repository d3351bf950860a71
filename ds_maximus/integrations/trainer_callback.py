"""HF Trainer: the maximus figures go into the Trainer's own logs instead of lines printed into its tqdm bars.

``ds_maximus.enable()`` adds :class:`MaximusTrainerCallback` to every later ``Trainer`` (through
``transformers.trainer.DEFAULT_CALLBACKS``). At each of the Trainer's log events it adds the figures of the
stats line (``maximus/embed_tokens/hit_rate``, ``maximus/moe/expert_hit_rate``, ...) to ``logs``, so they
appear beside ``loss`` in the console, in ``trainer.state.log_history`` and in every ``report_to``
integration (TensorBoard, W&B, ...); the engine stops printing its own stats lines. DeepSpeed monitors set
in the ds_config keep their ``Maximus/...`` events. A model that is not a maximus engine's is left alone.

Example::

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[MaximusTrainerCallback()])   # or ds_maximus.enable() before building it
"""
from __future__ import annotations

import functools

from transformers import TrainerCallback

from ds_maximus import observability


class MaximusTrainerCallback(TrainerCallback):
    """Adds the maximus stats of the engine that trains ``model`` to the Trainer's logs."""

    def _runtime(self, model):
        runtime = observability.runtime_of(model)
        if runtime is not None:
            observability.report_elsewhere(runtime)
        return runtime

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._runtime(model)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        runtime = self._runtime(model)
        if runtime is None or logs is None or runtime.engine is None:
            return
        fields = observability.log_fields(observability.stats(runtime.engine))
        logs.update(fields)
        # the Trainer appended its record of these logs before calling back: it gets the figures too
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(fields)


class _LocalRowTables:
    """The sharded embeddings of ``model`` as they are when iterated (``ds_maximus.initialize`` swaps them in after
    the Trainer is built), without the partitioned ones: their prefetch is a collective, which a collator the user
    did not choose should not start (wrap the collator in ``MaximusDataCollator`` to prefetch those too)."""

    def __init__(self, model):
        self.model = model

    def __iter__(self):
        from ds_maximus.integrations.hf import sharded_modules
        from ds_maximus.vocab import ShardedEmbedding
        if self.model is not None:
            yield from (m for m in sharded_modules(self.model) if isinstance(m, ShardedEmbedding))


def install_default_callback() -> None:
    """Make every ``Trainer`` built from now on carry a :class:`MaximusTrainerCallback` (idempotent), run its
    evaluation steps under :func:`~ds_maximus.integrations.hf_lm_head.loss_only` (no ``compute_metrics``: a
    streamed head computes no logits) or :func:`~ds_maximus.integrations.hf_lm_head.logits_wanted` (the metrics
    read the logits: the plain model computes them), and wrap its collator in
    :class:`~ds_maximus.integrations.hf.MaximusDataCollator`: accelerate's loader collates batch t+1 before it
    hands out batch t, so each batch's rows are prefetched into the row caches while the batch before trains (a
    lookup that misses fills its rows after the last step's copies of a tied table: the whole step, 125 ms a step
    at the Gemma-3-4B shape on an H100, ``docs/bench/peft_vocab.md``). A model without sharded rows is left alone
    (the wrapper finds none), and so is a collator that is already one; partitioned tables (a collective prefetch)
    are prefetched only by a collator the user wraps."""
    from transformers import trainer
    if MaximusTrainerCallback not in trainer.DEFAULT_CALLBACKS:
        trainer.DEFAULT_CALLBACKS.append(MaximusTrainerCallback)
    cls = trainer.Trainer
    if getattr(cls.__init__, "_maximus_orig", None) is None:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            from ds_maximus.integrations.hf import MaximusDataCollator
            init(self, *args, **kwargs)
            if self.data_collator is not None and not isinstance(self.data_collator, MaximusDataCollator):
                self.data_collator = MaximusDataCollator(self.data_collator, _LocalRowTables(self.model))

        __init__._maximus_orig = init
        cls.__init__ = __init__
    if getattr(cls.prediction_step, "_maximus_orig", None) is None:
        orig = cls.prediction_step

        @functools.wraps(orig)
        def prediction_step(self, model, inputs, prediction_loss_only, *args, **kwargs):
            from ds_maximus.integrations.hf_lm_head import logits_wanted, loss_only
            with loss_only() if prediction_loss_only else logits_wanted():
                return orig(self, model, inputs, prediction_loss_only, *args, **kwargs)

        prediction_step._maximus_orig = orig
        cls.prediction_step = prediction_step


def remove_default_callback() -> None:
    from transformers import trainer
    while MaximusTrainerCallback in trainer.DEFAULT_CALLBACKS:
        trainer.DEFAULT_CALLBACKS.remove(MaximusTrainerCallback)
    orig = getattr(trainer.Trainer.prediction_step, "_maximus_orig", None)
    if orig is not None:
        trainer.Trainer.prediction_step = orig
    orig = getattr(trainer.Trainer.__init__, "_maximus_orig", None)
    if orig is not None:
        trainer.Trainer.__init__ = orig
