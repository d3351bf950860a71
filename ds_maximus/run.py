"""Run a training script nobody changed with ds_maximus on: ``ds_maximus.enable()``, then the script as ``python``
would run it.

The script's own ``deepspeed.initialize`` (directly, or inside the HF ``Trainer`` or ``accelerate``) then goes
through ``ds_maximus.initialize``, so the ``"maximus"`` section of the ds_config it is given takes effect; without
one, it is plain DeepSpeed. ::

    python -m ds_maximus.run train.py --deepspeed ds_config.json ...          # or: maximus-run train.py ...
    python -m ds_maximus.run -m some.module --deepspeed ds_config.json ...    # a module, as python -m runs it
    deepspeed --num_gpus 2 --module ds_maximus.run train.py --deepspeed ds_config.json ...

Under the ``deepspeed`` launcher with ``--module``, the launcher puts its ``--local_rank=N`` before the script's
path; it is moved behind it, where the script would get it when launched directly.
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

USAGE = ("usage: python -m ds_maximus.run [--local_rank=N] SCRIPT.py [ARGS ...]\n"
         "       python -m ds_maximus.run [--local_rank=N] -m MODULE [ARGS ...]")


def _split(argv: List[str]):
    """``(launcher args to hand on, "path"|"module", target, script args)``; SystemExit with the usage otherwise."""
    handed = []
    i = 0
    while i < len(argv) and argv[i].startswith("--local_rank"):
        if argv[i] == "--local_rank" and i + 1 < len(argv):   # the "--local_rank N" spelling
            handed += argv[i:i + 2]
            i += 2
        else:
            handed.append(argv[i])
            i += 1
    rest = argv[i:]
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return handed, "module", rest[1], rest[2:]
    if not rest or rest[0].startswith("-"):
        raise SystemExit(USAGE)
    return handed, "path", rest[0], rest[1:]


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    handed, kind, target, args = _split(argv)
    if kind == "path" and not os.path.isfile(target):
        raise SystemExit(f"ds_maximus.run: no such script: {target}\n{USAGE}")
    import ds_maximus
    ds_maximus.enable()
    sys.argv = [target, *handed, *args]
    if kind == "module":
        sys.path.insert(0, os.getcwd())   # what python -m puts first
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))   # what python script.py puts first
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
