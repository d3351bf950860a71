"""patch_causal_lm_loss: a patched HF causal LM gives the original loss, no logits, and the same generate()."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from ds_maximus.integrations.hf_lm_head import patch_causal_lm_loss  # noqa: E402
from ds_maximus.vocab import ShardedLMHead  # noqa: E402
from tests.helpers.threads import torch_threads  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def _llama(seed=0, tie=False, vocab=300):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).eval()


def _batch(vocab=300, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 12), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100          # a masked prompt
    return ids, labels


def _loss_and_grads(model, ids, labels, **kw):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("tie", [False, True])
def test_patched_llama_loss_and_grads_equal_original(tie):
    ref, model = _llama(tie=tie), _llama(tie=tie)
    ids, labels = _batch()
    want, want_g = _loss_and_grads(ref, ids, labels)
    assert patch_causal_lm_loss(model, config={"chunk_rows": 64}) is None
    got, got_g = _loss_and_grads(model, ids, labels)
    assert got.logits is None and want.logits is not None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert set(got_g) == set(want_g)
    for n in want_g:
        torch.testing.assert_close(got_g[n], want_g[n], rtol=1e-4, atol=1e-6, msg=n)
    # Trainer-style kwargs: num_items_in_batch gives sum / n
    n_items = torch.tensor(20)
    a = ref(input_ids=ids, labels=labels, num_items_in_batch=n_items).loss
    b = model(input_ids=ids, labels=labels, num_items_in_batch=n_items).loss
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # tuple outputs: the logits entry is dropped
    t = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(t, tuple) and torch.is_tensor(t[0]) and t[0].dim() == 0


@pytest.mark.parametrize("eval_logits", ["auto", "on", "off"])
def test_a_call_without_gradient_streams_unless_the_logits_are_wanted(eval_logits):
    """Evaluation (labels under ``torch.no_grad``): ``auto`` streams (no logits) unless inside ``logits_wanted()``
    (the HF Trainer's metrics), then the plain model's logits and loss; ``on`` the plain model's everywhere but
    inside ``loss_only()``; ``off`` streams every call."""
    from ds_maximus.integrations.hf_lm_head import logits_wanted, loss_only
    ref, model = _llama(seed=2, tie=True), _llama(seed=2, tie=True)
    patch_causal_lm_loss(model, config={"chunk_rows": 64, "eval_logits": eval_logits})
    ids, labels = _batch()
    with torch.no_grad():
        want = ref(input_ids=ids, labels=labels)
        got = {"plain call": model(input_ids=ids, labels=labels)}
        with logits_wanted():
            got["logits_wanted"] = model(input_ids=ids, labels=labels)
            with loss_only():
                got["loss_only inside"] = model(input_ids=ids, labels=labels)
        with loss_only():
            got["loss_only"] = model(input_ids=ids, labels=labels)
    plain = {"auto": {"logits_wanted"}, "on": {"plain call", "logits_wanted"}, "off": set()}[eval_logits]
    for what, out in got.items():
        if what in plain:
            assert torch.equal(out.logits, want.logits) and torch.equal(out.loss, want.loss), what
        else:
            assert out.logits is None, what
            torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    with torch.enable_grad(), logits_wanted():   # training streams whatever the caller wants
        assert model(input_ids=ids, labels=labels).logits is None


def test_generation_unchanged():
    ref, model = _llama(seed=3), _llama(seed=3)
    patch_causal_lm_loss(model)
    ids, _ = _batch(seed=5)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)
        k = model(input_ids=ids, logits_to_keep=1).logits
        assert k.shape == (3, 1, 300)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:1], **kw), ref.generate(ids[:1], **kw))


def test_cpu_placed_head_replaces_lm_head_and_matches():
    ref, model = _llama(seed=7), _llama(seed=7)
    ids, labels = _batch(seed=8)
    want, want_g = _loss_and_grads(ref, ids, labels)
    head = patch_causal_lm_loss(model, config={"chunk_rows": 64, "placement": "cpu"})
    assert isinstance(head, ShardedLMHead) and head.owns_weights and model.lm_head is head
    assert "lm_head.weight" not in dict(model.named_parameters())
    assert len(head.removed_params) == 1
    got, got_g = _loss_and_grads(model, ids, labels)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    _, rows = head.sparse_grads()
    torch.testing.assert_close(rows, want_g["lm_head.weight"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got_g["model.norm.weight"], want_g["model.norm.weight"], rtol=1e-4, atol=1e-6)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:1], **kw), ref.generate(ids[:1], **kw))
    assert set(model.state_dict()) == set(ref.state_dict())


def test_rejects_non_causal_lm():
    with pytest.raises(TypeError, match="XForCausalLM"):
        patch_causal_lm_loss(torch.nn.Linear(3, 4))


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "mixtral"])
def test_other_causal_lms_same_loss(arch):
    """Mistral, Qwen2 and Mixtral (router aux loss added by the model's own code) give the original loss."""
    import transformers as tf
    common = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if arch == "mistral":
        cfg, cls = tf.MistralConfig(**common), tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    else:
        cfg = tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                               router_aux_loss_coef=0.1)
        cls = tf.MixtralForCausalLM
    torch.manual_seed(11)
    ref = cls(cfg).eval()
    model = cls(cfg).eval()
    model.load_state_dict(ref.state_dict())
    ids, labels = _batch(seed=12)
    want, want_g = _loss_and_grads(ref, ids, labels)
    patch_causal_lm_loss(model)
    got, got_g = _loss_and_grads(model, ids, labels)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_g["lm_head.weight"], want_g["lm_head.weight"], rtol=1e-4, atol=1e-6)
    if arch == "mixtral":
        assert got.aux_loss is not None and torch.isfinite(got.aux_loss)
