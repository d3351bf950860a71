"""Test setup: CPU DeepSpeed in one process (gloo), markers, and a clean skip for GPU tests."""
import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # tests import each other as ``tests.*``, under ``pytest`` as under ``python -m pytest``
    sys.path.insert(0, _ROOT)

from tests.distributed.ranks import free_port  # noqa: E402  (the standard library only: nothing heavy)


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


# DeepSpeed's CPU accelerator (gloo) here; its CUDA accelerator on the GPU machine
os.environ.setdefault("DS_ACCELERATOR", "cuda" if _has_cuda() else "cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(free_port()))
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(_ROOT, "build", "torch_extensions"))


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; runs on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """The compute device of this machine (cuda when present, else cpu)."""
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


_SHM_PREFIX = "deepspeed_allreduce_buffer_"


def _ds_shm_buffers() -> set:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(_SHM_PREFIX)}
    except OSError:
        return set()


@pytest.fixture(autouse=True)
def _drop_deepspeed_shm_buffers():
    """DeepSpeed's CPU accelerator maps a 66 MiB ``/dev/shm/deepspeed_allreduce_buffer_*`` per process and
    never unlinks it: over a test session (hundreds of DeepSpeed processes) these filled 20 GB of this
    machine's RAM-backed /dev/shm and made it swap. Each test's new ones are unlinked when it ends (a
    process still mapping one keeps its memory until it exits)."""
    before = _ds_shm_buffers()
    yield
    for name in _ds_shm_buffers() - before:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass


def pytest_sessionfinish(session, exitstatus):
    """Destroy the process group the in-process DeepSpeed engines initialised, before the interpreter exits.

    A gloo or NCCL group left alive at exit is torn down during interpreter shutdown: NCCL warns that
    ``destroy_process_group()`` was not called (the GPU machine's MoE tests), and a gloo group has aborted a
    2-rank script at exit ("terminate called without an active exception", the examples now destroy theirs).
    """
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # never turn a finished run into an error here
        pass


@pytest.fixture(autouse=True)
def _unset_hf_deepspeed_config():
    """A Trainer with a DeepSpeed config registers it with transformers through a weak reference that lives as long
    as the Trainer's arguments do; a ZeRO-3 one left alive by one test would make a later test's plain
    ``from_pretrained`` partition its weights (empty tensors). Cleared after every test, as HF's own tests do."""
    yield
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    except ImportError:
        return
    unset_hf_deepspeed_config()


_ENGINES = None


def _engine_registry():
    """Every DeepSpeed engine this process builds, weakly (registered from ``DeepSpeedEngine.__init__``)."""
    global _ENGINES
    if _ENGINES is None:
        import weakref

        from deepspeed.runtime.engine import DeepSpeedEngine
        _ENGINES = weakref.WeakSet()
        init = DeepSpeedEngine.__init__

        def _registered_init(self, *args, **kwargs):
            _ENGINES.add(self)
            init(self, *args, **kwargs)

        DeepSpeedEngine.__init__ = _registered_init
    return _ENGINES


@pytest.fixture(autouse=True)
def _destroy_test_engines():
    """A ZeRO-3 engine is kept alive by its own module hooks after a test drops it, and holds DeepSpeed's bucket
    buffers (2 GB of untouched ``reduce_bucket_size`` floats each): over a session those reached ~24 GB of committed
    address space and the kernel refused a later test's ``os.fork()`` (ENOMEM). The engines a test built are
    destroyed (``engine.destroy()``, as DeepSpeed's own tests do) when it ends; module-scoped fixtures' engines
    were built before this snapshot and stay."""
    engines = _engine_registry()
    before = set(map(id, engines))
    yield
    for engine in list(engines):
        if id(engine) not in before:
            try:
                engine.destroy()
            except Exception:  # a half-built engine: nothing of ours to clean
                pass
