"""``moe.decode_graphs``: a static-cache batch-1 decode step of each offloaded layer splits into the layer's
attention-and-router part (one CUDA graph on a GPU; the same split eagerly on the CPU), its offloaded experts and the
residual add; tokens and logits equal the layer's own forward bit for bit."""
import inspect
import logging

import pytest
import torch

from ds_maximus.errors import ConfigError
from ds_maximus.experts import offload_experts
from tests.helpers.scripts import load_script

from .tiny_moe import clone, tiny_model

GEN = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True,
           pad_token_id=0)


def run(model, ids, config=None, cache="static"):
    """Greedy decode of ``ids`` (after ``offload_experts(config)`` when given): (sequences, logits, handle)."""
    h = offload_experts(model, config) if config is not None else None
    out = model.generate(ids, cache_implementation=cache, **GEN)
    return out.sequences, torch.stack(out.logits), h


def same(a, b):
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_split_forward_equals_the_layer_cpu(kind):
    model = tiny_model(kind, "eager", layers=3)
    ids = torch.tensor([[5, 9, 17, 33, 2, 70]])
    ref = run(clone(model), ids)
    got = run(model, ids, {"gpu_experts_per_layer": 2, "decode_graphs": True})
    same(ref, got)
    h = got[2]
    # every decode step of every layer took the split (the prefill did not): 3 layers x 7 steps
    assert h.decode_graphs.eager_split == 3 * (GEN["max_new_tokens"] - 1)
    assert h.stats()["decode_graph_replays"] == 0  # no graphs on a CPU
    h.close()
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)  # the layers' own forward again


def test_off_and_dynamic_cache_run_the_layers_own_forward(caplog):
    model = tiny_model("mixtral", "eager")
    ids = torch.tensor([[5, 9, 17, 33]])
    ref = run(clone(model), ids, cache="dynamic")
    with caplog.at_level(logging.WARNING, logger="ds_maximus.experts.decode_graphs"):
        got = run(model, ids, {"gpu_experts_per_layer": 2, "decode_graphs": True}, cache="dynamic")
    same(ref, got)
    h = got[2]
    assert h.decode_graphs.eager_split == 0
    assert "static KV cache" in caplog.text and 'cache_implementation="static"' in caplog.text
    h.cfg.decode_graphs = False  # switched off between generations: the layers' own forward
    again = model.generate(ids, cache_implementation="static", **GEN)
    assert h.decode_graphs.eager_split == 0
    assert torch.equal(again.sequences, run(clone(tiny_model("mixtral", "eager")), ids)[0])
    h.close()


def test_off_by_default_installs_nothing():
    model = tiny_model("mixtral", "eager")
    h = offload_experts(model, {"gpu_experts_per_layer": 2})
    assert h.decode_graphs is None and all("forward" not in layer.__dict__ for layer in model.model.layers)
    h.close()


def test_generate_does_not_auto_compile_an_offloaded_model():
    """generate() with a static cache on a GPU would torch.compile the forward by itself: off while offloaded."""
    model = tiny_model("mixtral", "eager")
    assert not model.generation_config.disable_compile
    h = offload_experts(model, {"gpu_experts_per_layer": 2})
    assert model.generation_config.disable_compile
    h.close()
    assert not model.generation_config.disable_compile


def test_shared_inputs_are_copied_once_a_step():
    """The rotary, mask and position buffers every layer's graph reads are copied when a new tensor (or an in-place
    change of the last one) arrives, not once a layer."""
    from ds_maximus.experts.decode_graphs import DecodeGraphs
    g = DecodeGraphs([], lambda: True)
    cos = torch.randn(1, 1, 8)
    buf = g.buffer("cos", cos)
    assert torch.equal(buf, cos) and g.buffer("cos", torch.randn(1, 1, 8)) is buf  # one buffer a name and shape
    buf.zero_()
    g.refresh("cos", cos, buf)            # not the tensor copied last (the second one was)
    assert torch.equal(buf, cos)
    buf.zero_()
    g.refresh("cos", cos, buf)            # the same, unmodified: no copy
    assert not buf.any()
    cos.mul_(2)                           # changed in place: copied again
    g.refresh("cos", cos, buf)
    assert torch.equal(buf, cos)
    assert g.buffer("cos", torch.randn(1, 1, 4)) is not buf


def test_other_layer_classes_are_refused():
    model = tiny_model("qwen2_moe", "eager")  # a shared expert beside the routed ones: not the split's layer
    with pytest.raises(ConfigError, match="decode_graphs.*Qwen2MoeDecoderLayer"):
        offload_experts(model, {"gpu_experts_per_layer": 2, "decode_graphs": True})


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("config", [{"gpu_experts_per_layer": 2},
                                    {"gpu_experts_per_layer": 2, "quant": {"bits": 4, "group_size": 16}}])
def test_graphs_replay_the_layers_cuda(kind, config):
    """Captured at a cache's second decode step, replayed at every later one; a second generate (a new cache)
    captures again. Tokens and logits equal the same offload without graphs, bit for bit."""
    model = tiny_model(kind, "eager", layers=3, dtype=torch.bfloat16).cuda()
    ids = torch.tensor([[5, 9, 17, 33, 2, 70]]).cuda()
    ref = run(clone(model), ids, config)
    got = run(model, ids, {**config, "decode_graphs": True})
    same(ref, got)
    g = got[2].decode_graphs
    steps = GEN["max_new_tokens"] - 1
    assert (g.captures, g.replays, g.eager_split) == (3, 3 * (steps - 1), 3), g.failed  # why a capture failed
    again = run(model, ids)  # the handle's graphs stay on: a new static cache (captured again, unless the allocator
    same(ref, again)         # gave it the old one's addresses, which the graphs then serve as they are)
    assert g.replays == 3 * (steps - 1) + 3 * (steps - 1 if g.captures == 6 else steps)
    got[2].close()
    ref[2].close()


def test_example_runs_with_decode_graphs(capsys):
    """examples/generate_moe_offload.py --decode-graphs: the split forward on every decode step, the un-offloaded
    model's tokens (both with a static KV cache)."""
    mod = load_script("examples/generate_moe_offload.py")
    mod.main(["--decode-graphs", "--tokens", "6", "--layers", "2", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "identical to the un-offloaded model: True" in out and '"decode_graph_replays": 0' in out
    assert '"decode_graph_eager_steps": 10' in out  # 2 layers x 5 decode steps through the split (no graphs on a CPU)


@pytest.mark.parametrize("cache_name", ["cache", "past_key_values"])
def test_split_takes_the_arguments_as_the_layer_got_them(cache_name):
    """A decoder layer called with its cache under either name HF has used, and with a tensor argument beside the
    usual ones, gets the same output and cache from the split as from its own forward."""
    import copy
    import warnings

    from transformers import StaticCache
    model = tiny_model("mixtral", "eager", layers=1)
    # the model's own name for its cache in the installed transformers (5.x renamed past_key_values to cache, and
    # takes the old name too); a transformers from before the rename knows only past_key_values
    own = "cache" if "cache" in inspect.signature(type(model.model).forward).parameters else "past_key_values"
    if own == "past_key_values" and cache_name == "cache":
        pytest.skip("this transformers names the cache past_key_values only")
    h = offload_experts(model, {"gpu_experts_per_layer": 2, "decode_graphs": True})
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(torch.tensor([[5, 9, 17]]), use_cache=True, **{own: cache})   # a prefill fills the static cache
    layer = model.model.layers[0]
    x = torch.randn(1, 1, model.config.hidden_size)
    pos = torch.tensor([[3]])
    pe = model.model.rotary_emb(x, position_ids=pos)
    outs = []
    for on in (True, False):
        h.cfg.decode_graphs = on
        c = copy.deepcopy(cache)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deprecated name
            y = layer(x, position_embeddings=pe, attention_mask=None, position_ids=pos, use_cache=True,
                      **{cache_name: c})
        outs.append((y, c.layers[0].keys.clone(), int(c.get_seq_length())))
    assert h.decode_graphs.eager_split == 1
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][2] == outs[1][2] == 4
    h.close()


def test_a_failed_capture_runs_the_step_eagerly_and_stops_the_graphs(monkeypatch, caplog):
    """A layer whose capture raises (an op CUDA cannot capture) runs that step eagerly, with the same numbers, and
    the handle's later decode steps run without graphs, with one warning saying why (driven on the CPU through the
    GPU path's own replay function, the capture made to fail)."""
    import copy

    from transformers import StaticCache

    from ds_maximus.experts import decode_graphs as dg
    model = tiny_model("mixtral", "eager", layers=1)
    own = "cache" if "cache" in inspect.signature(type(model.model).forward).parameters else "past_key_values"
    h = offload_experts(model, {"gpu_experts_per_layer": 2, "decode_graphs": True})
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(torch.tensor([[5, 9, 17]]), use_cache=True, **{own: cache})
    layer, graphs = model.model.layers[0], h.decode_graphs
    ref_cache = copy.deepcopy(cache)

    def capture_fails(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore lines")
    monkeypatch.setattr(dg, "_capture", capture_fails)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="ds_maximus.experts.decode_graphs"):
        for pos in (3, 4):  # a cache's first step (eager), then the one that captures (and fails)
            x = torch.randn(1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(pos))
            p = torch.tensor([[pos]])
            cos, sin = model.model.rotary_emb(x, position_ids=p)
            inputs = {"cos": cos, "sin": sin, "position_ids": p}
            consts = {"attention_mask": None, "use_cache": True}
            got = dg._replay(graphs, layer, x, inputs, consts, own, cache)
            want = dg._pre_moe(layer, x, inputs, consts, own, ref_cache)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert graphs.failed == "RuntimeError: operation not permitted when stream is capturing"
    assert graphs.eager_split == 2 and graphs.captures == 0 and not graphs.steps
    assert not graphs.eligible(x, cache)  # later steps: the layer's own forward
    assert h.stats()["decode_graph_failed"] == graphs.failed
    assert sum("without graphs from now on" in r.message for r in caplog.records) == 1
    assert torch.equal(cache.layers[0].keys, ref_cache.layers[0].keys)
    h.close()


def test_a_layers_old_graph_lives_until_its_new_one_is_captured(monkeypatch):
    """A new cache's first step runs eagerly without dropping the layer's graph of the old cache; the capture at its
    second step replaces it. CUDA's caching allocator refuses a capture into a shared pool whose graphs were all
    destroyed (an internal assert, use_count > 0), so the pool must always hold a live graph. Driven on the CPU
    through the GPU path's replay function, the capture standing in by the eager step (the GPU test runs the real
    one, two generates in a row)."""
    from transformers import StaticCache

    from ds_maximus.experts import decode_graphs as dg
    model = tiny_model("mixtral", "eager", layers=1)
    own = "cache" if "cache" in inspect.signature(type(model.model).forward).parameters else "past_key_values"
    h = offload_experts(model, {"gpu_experts_per_layer": 2, "decode_graphs": True})
    layer, graphs = model.model.layers[0], h.decode_graphs
    alive_at_capture = []

    class Replayed:  # the CPU has no graphs: replay does nothing, the step's outputs are the capture's eager ones
        def replay(self):
            pass

    def capture(graphs_, layer_, hidden, inputs, consts, cache_name, cache, key):
        alive_at_capture.append(graphs_.steps.get(id(layer_)))
        out = dg._pre_moe(layer_, hidden, inputs, consts, cache_name, cache)
        graphs_.captures += 1
        return dg._Step(key, Replayed(), {"hidden": hidden.clone(), **{n: t.clone() for n, t in inputs.items()}}, out)
    monkeypatch.setattr(dg, "_capture", capture)
    steps = []
    with torch.no_grad():
        for _ in range(2):  # two caches, as two generate calls make
            cache = StaticCache(config=model.config, max_cache_len=16)
            model(torch.tensor([[5, 9, 17]]), use_cache=True, **{own: cache})
            for pos in (3, 4):  # the cache's first step (eager), then the one that captures
                x = torch.randn(1, 1, model.config.hidden_size)
                p = torch.tensor([[pos]])
                cos, sin = model.model.rotary_emb(x, position_ids=p)
                dg._replay(graphs, layer, x, {"cos": cos, "sin": sin, "position_ids": p},
                           {"attention_mask": None, "use_cache": True}, own, cache)
                steps.append(graphs.steps.get(id(layer)))
    assert graphs.captures == 2 and graphs.eager_split == 2 and graphs.failed is None
    first, second = steps[1], steps[3]
    assert steps[0] is None and first is not None and steps[2] is first  # kept through the new cache's eager step
    assert second is not first and alive_at_capture == [None, first]     # replaced only after the capture
    h.close()
