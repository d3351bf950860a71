"""The engine meets modules through ``MaximusModule`` only and imports no integration; integrations register
themselves (:mod:`ds_maximus.engine.adapters`), and the engine still drives plain models and Hugging Face ones."""
import ast
import pathlib

import pytest
import torch
from torch import nn

import ds_maximus
from ds_maximus.engine import adapters
from ds_maximus.engine.protocol import MaximusModule, ModuleRole
from tests.engine.llama_utils import maximus_section
from tests.helpers.models import ds_config, tiny_llama, train, zipf_batches

ENGINE = pathlib.Path(ds_maximus.__file__).parent / "engine"


def _tree(name: str) -> ast.AST:
    return ast.parse((ENGINE / name).read_text(), filename=name)


def _calls(tree: ast.AST, func: str):
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == func]


def test_runtime_dispatch_has_no_hasattr_and_no_module_names():
    """The runtime, the look-ahead, the swap and the partitioned checkpoint's load ask modules nothing by
    ``hasattr``; ``initialize`` asks only the caller's argparse ``args`` (DeepSpeed's own rule); the runtime
    compares no module name with ``"lm_head"``/``"moe"``."""
    for name in ("runtime.py", "lookahead.py", "swap.py", "../distributed/repartition.py"):
        found = [n.lineno for n in _calls(_tree(name), "hasattr")]
        assert not found, f"engine/{name} dispatches with hasattr at lines {found}"
    on_other = [n.lineno for n in _calls(_tree("initialize.py"), "hasattr")
                if not (isinstance(n.args[0], ast.Name) and n.args[0].id == "args")]
    assert not on_other, f"engine/initialize.py asks hasattr of something other than args at lines {on_other}"
    names = [n.lineno for n in ast.walk(_tree("runtime.py"))
             if isinstance(n, ast.Constant) and n.value in ("lm_head", "moe")]
    assert not names, f"engine/runtime.py decides by module name at lines {names}"


def test_tier_and_module_users_ask_the_protocols_not_hasattr():
    """Code that meets our own tiers, modules and stores asks their protocols (``Tier.whole_tables``/``nbytes``/
    ``mark_dirty_range``, the ``ShardStore`` class), never ``hasattr``; the one ``hasattr`` left is on the compiled
    op (whether this build has a kernel). ``observability.stats`` takes any object a user passes, so it is not
    scanned."""
    pkg = pathlib.Path(ds_maximus.__file__).parent
    on_op = {"partition/transfer.py"}
    for rel in ("distributed/partitioned_embedding.py", "partition/transfer.py", "partition/tier.py",
                "partition/store_tier.py", "vocab/sharded_state.py", "tokenmap/extend.py"):
        tree = ast.parse((pkg / rel).read_text(), filename=rel)
        found = [n.lineno for n in _calls(tree, "hasattr")
                 if not (rel in on_op and isinstance(n.args[0], ast.Name) and n.args[0].id == "op")]
        assert not found, f"{rel} dispatches with hasattr at lines {found}"


def test_engine_imports_no_integration():
    """No module under ds_maximus/engine imports ``ds_maximus.integrations`` (statically, or by a literal name)."""
    bad = []
    for path in sorted(ENGINE.glob("*.py")):
        for n in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(n, ast.Import):
                mods = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                mods = [n.module or ""] + [f"{n.module}.{a.name}" for a in n.names]
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                mods = [n.value] if n.value.startswith("ds_maximus.") else []
            else:
                continue
            bad += [f"{path.name}:{n.lineno} {m}" for m in mods if m.startswith("ds_maximus.integrations")]
    assert not bad, bad


def _driven_classes():
    from ds_maximus.distributed.partitioned_embedding import PartitionedEmbedding
    from ds_maximus.experts.training import ExpertTrainer
    from ds_maximus.vocab import ShardedEmbedding, ShardedLMHead
    return {ShardedEmbedding: ModuleRole.ROWS, PartitionedEmbedding: ModuleRole.ROWS,
            ShardedLMHead: ModuleRole.HEAD, ExpertTrainer: ModuleRole.EXPERTS}


def test_every_driven_class_implements_the_protocol():
    """Each class the swap, the head adapter or the expert attach can hand the runtime is a concrete
    ``MaximusModule`` with its role; the protocol refuses a class that leaves an abstract method out."""
    for cls, role in _driven_classes().items():
        assert issubclass(cls, MaximusModule) and issubclass(cls, nn.Module), cls
        assert not cls.__abstractmethods__, f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} abstract"
        assert cls.role is role, cls

    class Incomplete(MaximusModule, nn.Module):
        role = ModuleRole.ROWS

        def sparse_grads(self):
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, 1)

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


def test_partitioned_checkpoint_gives_a_replicated_module_rank_zeros_state(tmp_path):
    """``load_partitioned_checkpoint`` hands each module the per-rank states through the protocol; a module the
    ranks replicate (the default ``load_maximus_state_dicts``) takes rank 0's and never reads rank 1's file."""
    from ds_maximus.distributed.repartition import RANK_FILE, load_partitioned_checkpoint
    from ds_maximus.vocab import ShardedEmbedding
    saved, loaded = (ShardedEmbedding.from_embedding(nn.Embedding(24, 4)) for _ in range(2))
    assert not torch.equal(saved.full_weight(), loaded.full_weight())
    torch.save({"modules": {"emb": saved.maximus_state_dict()}, "steps": 3, "skipped_steps": 1},
               tmp_path / RANK_FILE.format(rank=0))
    torch.save({"modules": {}, "steps": 3, "skipped_steps": 1}, tmp_path / RANK_FILE.format(rank=1))  # no "emb"
    assert load_partitioned_checkpoint(str(tmp_path), {"emb": loaded}) == (3, 1)
    assert torch.equal(loaded.full_weight(), saved.full_weight())


def test_runtime_refuses_a_module_outside_the_protocol():
    from ds_maximus.config import MaximusConfig
    from ds_maximus.engine.runtime import MaximusRuntime
    with pytest.raises(TypeError, match="MaximusModule"):
        MaximusRuntime(None, {"emb": nn.Embedding(4, 2)}, MaximusConfig())


class PlainLM(nn.Module):
    """No Hugging Face: an embedding, a projection and a loss of its own."""

    def __init__(self, vocab: int = 384, dim: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, vocab)

    def forward(self, ids):
        logits = self.proj(self.tok(ids))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))


def test_plain_model_trains_through_initialize():
    """A plain ``nn.Module`` with an ``nn.Embedding``: swapped, stepped by the runtime, only touched rows move."""
    model = PlainLM()
    before = model.tok.weight.detach().clone()
    section = {"embedding": {"modules": ["tok"], "gpu_cache_rows": 64}, "logging": {"interval_steps": 5}}
    engine, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(),
                                       config=ds_config(0, maximus=section, wd=0.0, scheduler=False))
    try:
        emb = engine.module.tok
        assert isinstance(emb, MaximusModule) and emb.role is ModuleRole.ROWS
        assert list(engine.maximus.modules) == ["tok"]
        ids = torch.tensor([[1, 2, 3, 2]])
        for _ in range(2):
            engine.backward(engine(ids))
            engine.step()
        assert engine.maximus.steps == 2
        after = emb.full_weight()
        moved = (after - before).abs().sum(1) > 0
        assert moved[[1, 2, 3]].all() and int(moved.sum()) == 3
    finally:
        engine.destroy()


# ids without "gpu": the conftest skips every test whose keywords hold that word where no GPU is
@pytest.mark.parametrize("placement", [pytest.param("gpu", id="head_param"), pytest.param("cpu", id="head_tier")])
def test_hf_model_gets_its_head_through_the_registered_adapter(placement):
    """The Hugging Face adapter is registered by its integration and attaches the streamed head on a causal LM
    exactly as before: a CPU-tier head becomes a runtime module (role HEAD) and is stepped; a GPU head stays the
    model's parameter with a streamed loss."""
    assert "huggingface" in [a.name for a in adapters.adapters()]
    from ds_maximus.vocab import ShardedLMHead
    model = tiny_llama(0)
    section = {**maximus_section(cache_rows=64), "lm_head": {"enabled": True, "placement": placement,
                                                             "chunk_rows": 128}}
    engine, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(),
                                       config=ds_config(0, maximus=section))
    try:
        losses = train(engine, zipf_batches(2, 2, 8))
        assert all(x == x for x in losses)
        rt = engine.maximus
        heads = rt.of_role(ModuleRole.HEAD)
        if placement == "cpu":
            assert isinstance(engine.module.lm_head, ShardedLMHead) and heads == [engine.module.lm_head]
            assert rt.modules["lm_head"].stats()["steps"] == 2
        else:
            from ds_maximus.integrations.hf_lm_head import _ATTR
            assert heads == [] and "lm_head" not in rt.modules
            assert getattr(engine.module, _ATTR, None) is not None   # the loss is patched: streamed
        assert rt.of_role(ModuleRole.ROWS) == [engine.module.model.embed_tokens]
    finally:
        engine.destroy()


def test_adapters_enable_hooks_run_in_order():
    """``ds_maximus.enable()``/``disable()`` run every adapter's hooks (an integration's own installs)."""
    from ds_maximus.engine.initialize import disable, enable
    seen = []
    adapters.register_adapter(adapters.ModelAdapter("probe", on_enable=lambda: seen.append("on"),
                                                    on_disable=lambda: seen.append("off")))
    try:
        enable()
        disable()
    finally:
        adapters.unregister_adapter("probe")
    assert seen == ["on", "off"]
