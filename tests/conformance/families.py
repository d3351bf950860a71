"""Tiny random-weight configs of the dense Hugging Face families with big vocabularies.

Each :class:`Family` builds its model from a config (no download), names the embedding maximus swaps,
and makes a batch of the inputs its training script would pass (causal LM, masked LM, seq2seq).
Dropout is off everywhere so plain and maximus runs see the same computation. ``VOCAB`` is a few times
the row cache of the tests, so a Zipf batch stream evicts rows.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List

import torch

from tests.helpers.models import tiny_llama

VOCAB = 320
HIDDEN = 32


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], torch.nn.Module]     # a fresh model (the caller seeds torch first)
    modules: List[str]                       # maximus.embedding.modules
    kind: str = "causal"                     # causal | mlm | seq2seq
    auto: str = "AutoModelForCausalLM"       # the transformers Auto class that reloads a saved folder
    text_ids: int = VOCAB                    # ids at and above it are special (a multimodal model's image tokens)
    reload: tuple = ()                       # from_pretrained keyword arguments the saved folders reload with

    def batch(self, ids: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The forward inputs of one training step for the token ids ``ids`` [batch, seq]."""
        ids = ids.clamp(max=self.text_ids - 1)
        if self.kind == "mlm":
            labels = ids.clone()
            labels[:, ::3] = -100                    # a masked-LM loss covers some positions only
            return {"input_ids": ids, "labels": labels}
        return {"input_ids": ids, "labels": ids}


def _llama(tie: bool):
    return lambda: tiny_llama(seed=None, vocab=VOCAB, tie=tie)


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=8,
        final_logit_softcapping=3.0, attn_logit_softcapping=50.0, attn_implementation="eager"))


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=8,
        final_logit_softcapping=3.0, attn_implementation="eager"))


def _qwen(version: int):
    import transformers
    name = "Qwen2" if version == 2 else "Qwen3"
    cfg = getattr(transformers, f"{name}Config")(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, attn_implementation="eager",
        **({"head_dim": 8} if version == 3 else {}))
    return lambda: getattr(transformers, f"{name}ForCausalLM")(cfg)


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager"))


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM
    return Phi3ForCausalLM(Phi3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, attn_implementation="eager"))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      attn_implementation="eager"))


def _neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, attn_implementation="eager"))


def _opt():
    from transformers import OPTConfig, OPTForCausalLM
    return OPTForCausalLM(OPTConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=HIDDEN, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=0.0, attn_implementation="eager"))


def _cohere():
    """Cohere (Command-R, a 256K vocabulary): tied, its logits multiplied by ``logit_scale`` after the head."""
    from transformers import CohereConfig, CohereForCausalLM
    return CohereForCausalLM(CohereConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, logit_scale=0.3, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_implementation="eager"))


def _granite():
    """Granite: tied, embeddings, residuals and attention scaled, logits divided by ``logits_scaling``."""
    from transformers import GraniteConfig, GraniteForCausalLM
    return GraniteForCausalLM(GraniteConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, embedding_multiplier=12.0, logits_scaling=6.0,
        residual_multiplier=0.22, attention_multiplier=0.0078, tie_word_embeddings=True,
        attn_implementation="eager"))


def _bloom():
    """BLOOM (a 250,880-row multilingual vocabulary): tied, ALiBi, the embedding layer-normed."""
    from transformers import BloomConfig, BloomForCausalLM
    return BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=2, n_head=4,
                                        hidden_dropout=0.0, attention_dropout=0.0))


def _falcon():
    from transformers import FalconConfig, FalconForCausalLM
    return FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                          num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0))


def _gemma():
    """Gemma (v1, 256,000 rows): tied, the embedding scaled by sqrt(hidden) in the model's forward."""
    from transformers import GemmaConfig, GemmaForCausalLM
    return GemmaForCausalLM(GemmaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_implementation="eager"))


def _gemma3_multimodal():
    """The class the real Gemma-3-4B checkpoint loads as (``Gemma3ForConditionalGeneration``: a SigLIP tower beside
    the text model), trained on text."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig
    text = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                            sliding_window=8, attn_implementation="eager")
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=4)
    return Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2))


def _llama4():
    """Llama-4's text model (202,048 rows): its forward reads ``embed_tokens.weight.device``."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    return Llama4ForCausalLM(Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
        max_position_embeddings=64, attn_implementation="eager"))


def _gemma4_text(**kw):
    """A tiny Gemma-4 text config. ``rms_norm_eps`` 0.1: Gemma-4 normalizes the small outputs of its attention (values
    too), MLP and per-layer branches, and at the default 1e-6 these random 32-wide layers amplify a 4e-9 change of the
    embedding into 0.37 of the logits (plain against plain): no comparison could pass. 0.1 damps that to ~1e-5."""
    return dict(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=HIDDEN, hidden_size_per_layer_input=8,
                intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                max_position_embeddings=64, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                final_logit_softcapping=3.0, rms_norm_eps=0.1, **kw)


def _gemma4():
    """Gemma-4 (262,144 rows, tied, scaled) with its per-layer embedding, a second 262,144-row table."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    return Gemma4ForCausalLM(Gemma4TextConfig(**_gemma4_text(attn_implementation="eager")))


def _gemma3n():
    """Gemma-3n (262,144 rows, tied, scaled) with its per-layer embedding (262,144 x layers x 256 in E2B). Its pad
    row is zero, and a batch holding the pad id gives NaN gradients in the plain model, so the pad id is the last row
    and the batches leave it out (``text_ids``)."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig
    return Gemma3nForCausalLM(Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=HIDDEN, hidden_size_per_layer_input=8,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=64, sliding_window=8, laurel_rank=4, altup_num_inputs=2, num_kv_shared_layers=0,
        layer_types=["sliding_attention", "full_attention"], activation_sparsity_pattern=[0.0, 0.0],
        pad_token_id=VOCAB - 1, rms_norm_eps=0.1, attn_implementation="eager"))


GEMMA4_SPECIAL = 8  # the multimodal config's image, video, audio and boundary tokens: the top ids


def _gemma4_multimodal():
    """The class Gemma-4 checkpoints load as: its forward reads the pad row of ``embed_tokens.weight``."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    v = VOCAB
    return Gemma4ForConditionalGeneration(Gemma4Config(
        text_config=_gemma4_text(), audio_config=None,
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=8, position_embedding_size=64),
        boi_token_id=v - 5, eoi_token_id=v - 4, image_token_id=v - 3, video_token_id=v - 2, boa_token_id=v - 6,
        eoa_token_index=v - 7, audio_token_id=v - 8, attn_implementation="eager"))


def _qwen2_vl():
    """Qwen2-VL (151,936 rows): the language model under a vision tower."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    return Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=HIDDEN, num_heads=2), attn_implementation="eager"))


def _paligemma():
    """PaliGemma (257,216 rows): a Gemma language model with scaled embeddings under a SigLIP tower."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration
    cfg = PaliGemmaConfig(
        text_config=dict(model_type="gemma", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=8),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14, projection_dim=HIDDEN),
        image_token_index=VOCAB - 1, projection_dim=HIDDEN, attn_implementation="eager")
    cfg.text_config.vocab_size = VOCAB
    return PaliGemmaForConditionalGeneration(cfg)


def _mbart():
    """mBART-50 (250,054 rows): tied encoder, decoder and head, scaled embeddings."""
    from transformers import MBartConfig, MBartForConditionalGeneration
    return MBartForConditionalGeneration(MBartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, scale_embedding=True))


def _m2m100():
    """M2M100, the architecture of NLLB-200 (256,206 rows): scaled embeddings as a module subclass, tied."""
    from transformers import M2M100Config, M2M100ForConditionalGeneration
    return M2M100ForConditionalGeneration(M2M100Config(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, scale_embedding=True, encoder_layerdrop=0.0,
        decoder_layerdrop=0.0))


def _bert():
    from transformers import BertConfig, BertForMaskedLM
    return BertForMaskedLM(BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager"))


def _roberta(xlm: bool):
    import transformers
    name = "XLMRoberta" if xlm else "Roberta"
    cfg = getattr(transformers, f"{name}Config")(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=80, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager")
    return lambda: getattr(transformers, f"{name}ForMaskedLM")(cfg)


def _deberta():
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM
    return DebertaV2ForMaskedLM(DebertaV2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _t5(mt5: bool):
    import transformers
    name = "MT5" if mt5 else "T5"
    cfg = getattr(transformers, f"{name}Config")(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=not mt5)
    return lambda: getattr(transformers, f"{name}ForConditionalGeneration")(cfg)


FAMILIES: Dict[str, Family] = {f.name: f for f in [
    Family("llama", _llama(False), ["model.embed_tokens"]),
    Family("llama_tied", _llama(True), ["model.embed_tokens"]),
    Family("gemma2", _gemma2, ["model.embed_tokens"]),
    Family("gemma3", _gemma3, ["model.embed_tokens"]),
    Family("qwen2_tied", _qwen(2), ["model.embed_tokens"]),
    Family("qwen3_tied", _qwen(3), ["model.embed_tokens"]),
    Family("mistral", _mistral, ["model.embed_tokens"]),
    Family("phi3", _phi3, ["model.embed_tokens"]),
    Family("cohere", _cohere, ["model.embed_tokens"]),
    Family("granite", _granite, ["model.embed_tokens"]),
    Family("bloom", _bloom, ["transformer.word_embeddings"]),
    Family("falcon", _falcon, ["transformer.word_embeddings"]),
    Family("gemma", _gemma, ["model.embed_tokens"]),
    Family("gemma3_multimodal", _gemma3_multimodal, ["model.language_model.embed_tokens"],
           auto="AutoModelForImageTextToText"),
    Family("llama4", _llama4, ["model.embed_tokens"]),
    Family("gemma4", _gemma4, ["model.embed_tokens", "model.embed_tokens_per_layer"]),
    Family("gemma4_multimodal", _gemma4_multimodal,
           ["model.language_model.embed_tokens", "model.language_model.embed_tokens_per_layer"],
           auto="AutoModelForImageTextToText", text_ids=VOCAB - GEMMA4_SPECIAL),
    Family("gemma3n", _gemma3n, ["model.embed_tokens", "model.embed_tokens_per_layer"], text_ids=VOCAB - 1),
    Family("qwen2_vl", _qwen2_vl, ["model.language_model.embed_tokens"], auto="AutoModelForImageTextToText"),
    # reloaded eager, as built: PaliGemma's sdpa and eager prefix masks give other logits (0.42 apart, plain alone)
    Family("paligemma", _paligemma, ["model.language_model.embed_tokens"], auto="AutoModelForImageTextToText",
           text_ids=VOCAB - 1, reload=(("attn_implementation", "eager"),)),
    Family("gpt2", _gpt2, ["transformer.wte"]),
    Family("gpt_neox", _neox, ["gpt_neox.embed_in"]),
    Family("opt", _opt, ["model.decoder.embed_tokens"]),
    Family("bert_mlm", _bert, ["bert.embeddings.word_embeddings"], "mlm", "AutoModelForMaskedLM"),
    Family("roberta_mlm", _roberta(False), ["roberta.embeddings.word_embeddings"], "mlm", "AutoModelForMaskedLM"),
    Family("xlm_roberta_mlm", _roberta(True), ["roberta.embeddings.word_embeddings"], "mlm",
           "AutoModelForMaskedLM"),
    Family("deberta_v2_mlm", _deberta, ["deberta.embeddings.word_embeddings"], "mlm", "AutoModelForMaskedLM"),
    Family("t5_tied", _t5(False), ["shared"], "seq2seq", "AutoModelForSeq2SeqLM"),
    Family("mt5_untied", _t5(True), ["shared"], "seq2seq", "AutoModelForSeq2SeqLM"),
    Family("mbart", _mbart, ["model.shared"], "seq2seq", "AutoModelForSeq2SeqLM"),
    Family("m2m100", _m2m100, ["model.shared"], "seq2seq", "AutoModelForSeq2SeqLM"),
]}
