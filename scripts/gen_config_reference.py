"""Regenerate the key table of ds_configs/README.md from MaximusConfig's fields and docstrings.

    python scripts/gen_config_reference.py            # print the table
    python scripts/gen_config_reference.py --write    # replace the table in ds_configs/README.md
    python scripts/gen_config_reference.py --check    # exit 1 (and show the difference) if the README is stale

The README's table is the run of ``|`` lines that starts at the header row; everything around it is kept.
CI runs the check (``tests/test_hygiene.py``), so a config field cannot change without its row.
"""
import argparse
import difflib
import enum
import os
import sys
import typing

from pydantic import BaseModel

from ds_maximus.config import MaximusConfig


def _type_name(ann) -> str:
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in ann)
    origin = typing.get_origin(ann)
    if origin is typing.Union:
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        return "null or " + " \\| ".join(_type_name(a) for a in args)
    if origin in (list, typing.List):
        return f"list of {_type_name(typing.get_args(ann)[0])}"
    return getattr(ann, "__name__", str(ann))


def _unit(name: str) -> str:
    for suffix, unit in (("_bytes", "bytes"), ("_rows", "rows"), ("_steps", "steps"), ("_s", "seconds"),
                         ("_shards", "shards"), ("_ms", "ms")):
        if name.endswith(suffix):
            return unit
    return ""


def rows(model, prefix=""):
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from rows(ann, f"{prefix}{name}.")
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, enum.Enum):
            default = default.value
        doc = (field.description or "").replace("\n", " ")
        yield f"| `{prefix}{name}` | {_type_name(ann)} | `{default!r}` | {_unit(name)} | {doc} |"


HEADER = "| key (under `\"maximus\"`) | type | default | unit | meaning |"
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ds_configs", "README.md")


def table() -> str:
    """The reference table: header, separator and one row per leaf field, newline-terminated."""
    return "\n".join([HEADER, "|---|---|---|---|---|", *rows(MaximusConfig)]) + "\n"


def with_table(readme: str, new_table: str) -> str:
    """``readme`` with its table (the ``|`` lines from ``HEADER`` on) replaced by ``new_table``."""
    lines = readme.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.rstrip("\n") == HEADER)
    except StopIteration:
        raise SystemExit(f"{README} has no table header {HEADER!r}: put the header row where the table goes") from None
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "".join(lines[:start]) + new_table + "".join(lines[end:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the table in ds_configs/README.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if ds_configs/README.md's table is stale")
    a = ap.parse_args(argv)
    if not (a.write or a.check):
        sys.stdout.write(table())
        return 0
    with open(README) as fh:
        old = fh.read()
    new = with_table(old, table())
    if a.check:
        if new == old:
            return 0
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                                   "ds_configs/README.md", "regenerated"))
        print("ds_configs/README.md is stale: run python scripts/gen_config_reference.py --write", file=sys.stderr)
        return 1
    if new != old:
        with open(README, "w") as fh:
            fh.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
