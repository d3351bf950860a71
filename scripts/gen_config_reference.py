"""Regenerate the key table of ds_configs/README.md from MaximusConfig's fields and docstrings.

    python scripts/gen_config_reference.py > /tmp/table.md
"""
import enum
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


if __name__ == "__main__":
    print("| key (under `\"maximus\"`) | type | default | unit | meaning |")
    print("|---|---|---|---|---|")
    for r in rows(MaximusConfig):
        print(r)
