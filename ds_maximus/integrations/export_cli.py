"""``maximus-export``: a maximus DeepSpeed checkpoint folder -> an ordinary Hugging Face folder.

Like DeepSpeed's ``zero_to_fp32.py``, it needs no GPU and no model instance: dense parameters come
from DeepSpeed's files (any ZeRO stage), the sharded tables from ``maximus_states.pt``::

    maximus-export ckpt/ out/hf --model-config my_model/ --token-map tokenmap/
    maximus-export ckpt/ out/hf_base --tag global_step100 --token-map tokenmap/ --original-order
    python -m ds_maximus.integrations.export_cli --help

The model config is ``--model-config DIR`` (a folder with config.json) or a config.json saved beside
the checkpoint (in ``ckpt/<tag>/`` or ``ckpt/``).
"""
from __future__ import annotations

import argparse
import logging
import sys

from ds_maximus.errors import MaximusError
from ds_maximus.integrations.export import (
    DTYPES,
    _resolve_tag,
    checkpoint_state_dict,
    find_model_config,
    write_hf_folder,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="maximus-export",
                                description="Write a maximus DeepSpeed checkpoint as a plain Hugging Face folder "
                                            "(config, safetensors with full embedding/head, tokenizer).")
    p.add_argument("checkpoint_dir", help="DeepSpeed checkpoint folder (the one holding 'latest' and tag folders)")
    p.add_argument("out_dir", help="output folder (written to a temporary sibling, then renamed)")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    p.add_argument("--model-config", default=None,
                   help="Hugging Face config folder of the model (default: config.json beside the checkpoint)")
    p.add_argument("--token-map", default=None,
                   help="token map folder the model was trained with: its tokenizer is written, and "
                        "--original-order uses its id maps")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer folder to write instead of the token map's (written as given)")
    p.add_argument("--original-order", action="store_true",
                   help="write the rows back in the base tokenizer's order, with the base tokenizer")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="dtype of the written weights (default fp32, as zero_to_fp32)")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="load checkpoint files that need types outside the safe allow-list (pickled code in them "
                        "can run): only for checkpoints you wrote yourself")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        tag = _resolve_tag(args.checkpoint_dir, args.tag)
        config = find_model_config(args.checkpoint_dir, tag, args.model_config)
        sd = checkpoint_state_dict(args.checkpoint_dir, tag, trust_checkpoint=args.trust_checkpoint)
        out = write_hf_folder(sd, config, args.out_dir, tokenizer=args.tokenizer, token_map=args.token_map,
                              original_order=args.original_order, dtype=DTYPES[args.dtype],
                              max_shard_size=args.max_shard_size)
    except (MaximusError, FileNotFoundError) as e:
        print(f"maximus-export: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
