"""Load a script of the repository (an example, a GPU script) as a module, to call its ``main`` in process."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script(relpath: str, name: str = None):
    """The module of ``ROOT / relpath`` (e.g. ``"examples/generate_moe_offload.py"``), executed once here."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
