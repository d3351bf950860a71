"""Code hygiene that review alone does not keep: no file-level import cycle in the package, and no development
history (numbered work rounds, commit hashes, timings of past runs) in code comments, docstrings, config docs or the
README. House rule 11: code says what and why; measurements and history live in ``docs/bench/``."""
from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "ds_maximus"


# ---- import cycles -----------------------------------------------------------------------------------------------

def _module_files(package: str = PACKAGE, root: str = ROOT) -> Dict[str, str]:
    """Dotted module name -> file, for every ``.py`` under ``root/package`` (a package is named by its
    ``__init__``)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, package)):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(dirpath, name)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(tree: ast.Module) -> Iterator[ast.stmt]:
    """``import``/``from`` statements that run when the module is imported: the module body, including its
    ``if``/``try``/``with`` blocks and class bodies, but not function bodies nor ``if TYPE_CHECKING:`` blocks."""
    todo: List[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []) or []:
                    if isinstance(child, ast.ExceptHandler):
                        todo.extend(child.body)
                    elif isinstance(child, ast.stmt):
                        todo.append(child)


def _resolve(module: str, is_package: bool, node: ast.stmt, modules: Dict[str, str]) -> Set[str]:
    """The package modules an import statement of ``module`` loads directly (``from pkg import sub`` loads the
    submodule ``pkg.sub``; ``from pkg import name`` loads ``pkg``'s ``__init__``)."""
    out: Set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in modules:
                out.add(alias.name)
        return out
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        if sub in modules:
            out.add(sub)
        elif target in modules:
            out.add(target)
    return out


def import_graph(package: str = PACKAGE, root: str = ROOT) -> Dict[str, Set[str]]:
    """Module -> the package modules its module-level imports load."""
    modules = _module_files(package, root)
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        is_package = os.path.basename(path) == "__init__.py"
        deps: Set[str] = set()
        for node in _module_level_imports(tree):
            deps |= _resolve(name, is_package, node, modules)
        deps.discard(name)
        graph[name] = deps
    return graph


def find_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle (``a -> b -> ... -> a``) per strongly connected component of more than one module."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    comps: List[List[str]] = []

    def strong(v: str) -> None:  # Tarjan; the package is a few hundred modules, recursion depth is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return [_cycle_in(graph, set(c)) for c in comps]


def _cycle_in(graph: Dict[str, Set[str]], comp: Set[str]) -> List[str]:
    """A shortest cycle through the first module of ``comp`` (breadth-first inside the component)."""
    start = min(comp)
    prev: Dict[str, Optional[str]] = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(comp)}")


def test_the_scanner_finds_a_cycle_and_resolves_relative_and_package_imports(tmp_path):
    """The scanner itself, on a small package: a relative cycle through a package ``__init__`` is found; a
    function-level and a ``TYPE_CHECKING`` import are not edges."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("from .sub import helper\nA = 1\n")
    (pkg / "sub" / "__init__.py").write_text("from . import helper\n")
    (pkg / "sub" / "helper.py").write_text("try:\n    from pkg import A\nexcept ImportError:\n    pass\n")
    (pkg / "late.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
                                 "def f():\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("import pkg.late\n")
    graph = import_graph("pkg", str(tmp_path))
    assert graph["pkg.a"] == {"pkg.sub.helper"} and graph["pkg.sub"] == {"pkg.sub.helper"}
    assert graph["pkg.sub.helper"] == {"pkg"} and graph["pkg.late"] == set() and graph["pkg.b"] == {"pkg.late"}
    assert find_cycles(graph) == [["pkg", "pkg.a", "pkg.sub.helper", "pkg"]]


def test_no_file_level_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "file-level import cycles (module-level imports; break them by moving the shared part " \
        "into a module both import):\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


@pytest.mark.parametrize("a,b", [("ds_maximus.integrations.export", "ds_maximus.integrations.export_cli"),
                                 ("ds_maximus.tokenmap.token_map", "ds_maximus.tokenmap.extend")])
def test_former_cycles_stay_one_way_even_inside_functions(a, b):
    """These two pairs imported each other (one side from inside a function): the CLI uses the export, never the
    reverse; the token map uses its extension, which shares ``tokenizer_json`` and ``converted`` with it and the
    converter instead of importing the token map."""
    def all_imports(module: str) -> Set[str]:
        modules = _module_files()
        path = modules[module]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        deps: Set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= _resolve(module, path.endswith("__init__.py"), node, modules)
        return deps
    assert not (b in all_imports(a) and a in all_imports(b)), f"{a} and {b} import each other"


# ---- development history in code and docs ------------------------------------------------------------------------

_SAME_SENTENCE = r"(?:[^.;]|\.(?=\d))"  # a character that does not end the sentence (a decimal point does not)
_HASH = r"(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}"  # hex with a digit and a letter (not 1048576)
_GPU = r"(?<![\w-])[HA][12]00s?\b"  # a GPU model named as the machine of a run (not a device kind, nvidia-h200-x2)

#: (name, pattern) of what house rule 11 keeps out of code comments, docstrings, config docs and the README
HISTORY_PATTERNS = [
    ("numbered work round", re.compile(r"\b(?:work[- ]?)?(?:rounds?|sessions?|iterations?) #?\d+(?:-\d+)?\b", re.I)),
    ("numbered round tag", re.compile(r"(?<![\w-])R\d{1,2}\b")),
    ("commit hash", re.compile(rf"`{_HASH}`|\bcommits? \(?{_HASH}\b"
                               rf"|\b(?:at|since|before|after|in|by|from|to) {_HASH}\b")),
    ("timing of a past run", re.compile(
        rf"{_GPU}{_SAME_SENTENCE}{{0,120}}?\b(?:measured|took|ran|showed|peaked|profiled|runs?\b(?!:))"
        rf"|{_GPU} profiles?\b"
        rf"|\b(?:measured|took|ran|showed|peaked|profiled)\b{_SAME_SENTENCE}{{0,120}}?{_GPU}"
        rf"|\bmeasured\b{_SAME_SENTENCE}{{0,80}}?\d+(?:\.\d+)?\s?(?:ms|s|GB/s|GiB/s|tokens/s)\b", re.I)),
]

#: what is scanned: folders (comments and docstrings of their code) and documents (their whole text)
CODE_DIRS = ["ds_maximus", "op_builder", "csrc", "examples", "scripts", "benchmarks"]
DOCS = ["README.md", os.path.join("ds_configs", "README.md")]
_CODE_EXT = (".py", ".sh", ".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh")


def _code_files() -> List[str]:
    out = []
    for top in CODE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
            out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(_CODE_EXT)]
    return out


def _python_prose(src: str) -> Iterator[Tuple[int, str]]:
    """(line, text) of every comment and every bare string statement (docstrings, attribute docstrings such as the
    config's field docs) of a Python source; strings the code uses (printed tables, messages) are not prose."""
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value


def _c_prose(src: str) -> Iterator[Tuple[int, str]]:
    for m in re.finditer(r"//[^\n]*|/\*.*?\*/", src, re.S):
        yield src.count("\n", 0, m.start()) + 1, m.group(0)


def _shell_prose(src: str) -> Iterator[Tuple[int, str]]:
    for i, line in enumerate(src.splitlines(), 1):
        m = re.search(r"(?:^|\s)(#.*)$", line)
        if m and not line.startswith("#!"):
            yield i, m.group(1)


def _prose(path: str) -> Iterator[Tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        src = f.read()
    if path.endswith(".py"):
        return _python_prose(src)
    if path.endswith(".sh"):
        return _shell_prose(src)
    return _c_prose(src)


def _joined(chunks: Iterator[Tuple[int, str]]) -> Iterator[Tuple[int, str]]:
    """Consecutive comment lines joined into one text (a sentence often runs over several ``#`` lines)."""
    run_start, run_end, run = None, None, []
    for line, text in sorted(chunks):
        text = re.sub(r"^\s*(?:#+|//+)\s?", "", text)
        if run and line == run_end + 1 and "\n" not in text:
            run.append(text)
            run_end = line
            continue
        if run:
            yield run_start, " ".join(run)
        run_start, run_end, run = line, line + text.count("\n"), [text]
    if run:
        yield run_start, " ".join(run)


def history_hits(text: str, kinds: Optional[Set[str]] = None) -> List[Tuple[str, str]]:
    """(kind, the matching text) of every history pattern (of ``kinds``, default all) in ``text`` (lines joined: a
    figure and its machine are often a line apart)."""
    flat = re.sub(r"\s+", " ", text)
    return [(kind, m.group(0)) for kind, rx in HISTORY_PATTERNS if kinds is None or kind in kinds
            for m in rx.finditer(flat)]


@pytest.mark.parametrize("text,kinds", [
    ("# the share was still 0.3 after the H200 run's 3 steps", {"timing of a past run"}),
    ("as batch_plan's did (session 12)", {"numbered work round"}),
    ("see R16 and work-round 3", {"numbered round tag", "numbered work round"}),
    ("fixed in `e5a1ba6`; commit 4638dfc", {"commit hash"}),
    ("block_bytes `1048576`; `536870912` bytes; the nvidia-h200-x2 kind runs every rank", set()),
    ("on the H200: 11.8 tokens/s against 11.4 measured", {"timing of a past run"}),
    ("grad_sum took 62 ms for 22M elements on the H200 host", {"timing of a past run"}),
    ("a backward round's gradient buffer; 8 rounds a step; A100-class GPUs; 0x7fffffff; RTX 4090", set()),
    ("seconds each peer needs on an H200 at full size (an estimate the budget uses)", set()),
])
def test_the_history_patterns(text, kinds):
    assert {k for k, _ in history_hits(text)} == kinds


def test_no_development_history_in_code_comments_and_docstrings():
    found = []
    for path in _code_files():
        for line, text in _joined(_prose(path)):
            found += [f"{os.path.relpath(path, ROOT)}:{line}: {kind}: {hit!r}" for kind, hit in history_hits(text)]
    assert not found, "code says what and why, never when; move figures and history to docs/bench/ " \
        "(house rule 11):\n" + "\n".join(found)


@pytest.mark.parametrize("doc", DOCS)
def test_no_development_history_in_the_readmes(doc):
    """Both READMEs: no numbered rounds nor commit hashes. The config reference (generated from the field docs) has
    no timings of past runs either; the README's results table names its machine and that every peer was measured
    in the same run, as house rule 10 asks, so timings are not matched there."""
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        lines = f.read().splitlines()
    kinds = {k for k, _ in HISTORY_PATTERNS} - ({"timing of a past run"} if doc == "README.md" else set())
    found = [f"{doc}:{i}: {kind}: {hit!r}" for i, line in enumerate(lines, 1)
             for kind, hit in history_hits(line, kinds)]
    assert not found, "the README is a manual: figures and history belong in docs/bench/ (house rule 11):\n" + \
        "\n".join(found)


def _console_scripts() -> Dict[str, str]:
    """name -> ``module:function`` of every console script that setup.py or pyproject.toml declares."""
    out: Dict[str, str] = {}
    setup_py = os.path.join(ROOT, "setup.py")
    if os.path.isfile(setup_py):
        with open(setup_py, encoding="utf-8") as f:
            out.update(re.findall(r"[\"']([\w-]+)\s*=\s*([\w.]+:\w+)[\"']", f.read()))
    pyproject = os.path.join(ROOT, "pyproject.toml")
    if os.path.isfile(pyproject):
        import tomllib
        with open(pyproject, "rb") as f:
            out.update(tomllib.load(f).get("project", {}).get("scripts", {}))
    return out


def test_console_scripts_point_at_functions_that_exist():
    """A moved ``main`` (``maximus-export`` lives in ``export_cli``, which imports the export, not the reverse)
    leaves no console script pointing at a name that is gone."""
    import importlib
    scripts = _console_scripts()
    assert "maximus-export" in scripts
    bad = []
    for name, target in sorted(scripts.items()):
        module, func = target.split(":")
        if not callable(getattr(importlib.import_module(module), func, None)):
            bad.append(f"{name} = {target}")
    assert not bad, "console scripts whose function does not exist: " + ", ".join(bad)


IMPORT_FIRST = r'''
import importlib, json, os, sys
import torch  # noqa: F401  (the heavy dependencies stay loaded; only our modules are imported afresh)
root = sys.argv[1]
mods = []
for d, _, files in os.walk(os.path.join(root, "ds_maximus")):
    for f in sorted(files):
        if f.endswith(".py"):
            rel = os.path.relpath(os.path.join(d, f), root)[:-3].replace(os.sep, ".")
            mods.append(rel[: -len(".__init__")] if rel.endswith(".__init__") else rel)
bad = []
for m in sorted(mods):
    for k in [k for k in sys.modules if k == "ds_maximus" or k.startswith("ds_maximus.")]:
        del sys.modules[k]
    try:
        importlib.import_module(m)
    except ImportError as e:
        if "partially initialized" in str(e) or "circular import" in str(e):
            bad.append([m, str(e)])
print(json.dumps(bad))
'''


def test_every_module_imports_first():
    """Each module imported as the first of the package (a fresh ``ds_maximus`` every time): a cycle through a
    package ``__init__`` that the file-level scan above does not model (``ops.expert_cpu`` -> ``experts.quant``
    runs ``experts/__init__``, which reaches back into ``ops.expert_cpu``) fails here with the module that
    was imported first."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    out = subprocess.run([sys.executable, "-c", IMPORT_FIRST, root], capture_output=True, text=True, env=env,
                         cwd=root, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    bad = json.loads(out.stdout.strip().splitlines()[-1])
    assert not bad, "modules that fail when imported first:\n" + "\n".join(f"  {m}: {e}" for m, e in bad)
