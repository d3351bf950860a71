"""What ``ds_maximus.initialize`` swapped and what it left alone, one line each, logged on rank 0.

A ``"maximus"`` section whose tables all fall under ``embedding.min_rows`` would otherwise train plain
DeepSpeed without a word. Rank 0 prints the lines once the engine is built. Example of the lines::

    ds_maximus: model.embed_tokens -> ShardedEmbedding: 40000 rows x 64, tier cpu (pinned), GPU cache 4096 rows
    ds_maximus: left alone: model.embed_tokens (384 rows x 32): 384 rows < embedding.min_rows=32768; set ...
"""
from __future__ import annotations

from typing import Dict, List

from torch import nn

from ds_maximus.config import MaximusConfig, OffloadConfig, OffloadDevice
from ds_maximus.engine.protocol import MaximusModule, ModuleRole
from ds_maximus.engine.swap import bypassed_original
from ds_maximus.experts.expert_cache import slot_range

# an embedding with at least this many rows that maximus leaves alone gets a line saying why (so does the
# model's input embedding, whatever its size); smaller ones (position tables, token types) are not news
LARGE_ROWS = 8192


def _tier(off: OffloadConfig) -> str:
    if off.device == OffloadDevice.NVME:
        return f"nvme ({off.nvme_path}, {off.cpu_cache_shards} shards cached in CPU memory)"
    return "cpu (pinned)" if off.pin_memory else "cpu"


def swapped_lines(modules: Dict[str, MaximusModule], tied_heads: Dict[str, str], cfg: MaximusConfig) -> List[str]:
    """One line per module maximus now drives (by its role): name, rows, dim, tier, cache size."""
    lines = []
    for name, m in modules.items():
        if m.role is ModuleRole.EXPERTS:
            lines.append(f"ds_maximus: MoE experts -> partitions: {m.num_layers} layers x {m.num_experts} experts "
                         f"of {m.numel} parameters, tier {_tier(cfg.moe.offload)}, GPU cache "
                         f"{slot_range(m.slots)} experts per layer, optimizer on "
                         f"{cfg.moe.optimizer_device.value}")
        elif m.role is ModuleRole.HEAD:
            lines.append(f"ds_maximus: lm_head -> {type(m).__name__}: {m.vocab_size} rows x {m.hidden_size}, "
                         f"placement {cfg.lm_head.placement.value}, streamed {cfg.lm_head.chunk_rows} rows a chunk")
        else:
            rows, dim = m.num_embeddings, m.embedding_dim
            heads = [h for h, e in tied_heads.items() if e == name]
            lines.append(f"ds_maximus: {name} -> {type(m).__name__}: {rows} rows x {dim}, tier "
                         f"{_tier(cfg.embedding.offload)}, GPU cache {min(cfg.embedding.gpu_cache_rows, rows)} rows"
                         + (f", tied head {', '.join(heads)}" if heads else ""))
    return lines


def streamed_head_line(model: nn.Module, modules: Dict[str, nn.Module], cfg: MaximusConfig) -> List[str]:
    """With ``lm_head.enabled`` and a head that stays the model's (placement ``gpu``, or tied to a swapped
    table): one line saying its loss is streamed."""
    head = getattr(model, "lm_head", None)
    driven = any(m.role is ModuleRole.HEAD for m in modules.values())
    if not cfg.lm_head.enabled or driven or not isinstance(head, nn.Module):
        return []
    rows, dim = getattr(head, "vocab_size", None), getattr(head, "hidden_size", None)
    from ds_maximus.vocab import plain_weight
    w = plain_weight(head)   # (a tied ShardedLMHead's .weight would build the whole table to print its shape)
    if rows is None and w is not None:
        rows, dim = getattr(w, "ds_shape", w.shape)  # ZeRO-3 leaves a partitioned [0] view; ds_shape is the whole
    return [f"ds_maximus: lm_head ({type(head).__name__}, {rows} rows x {dim}): loss streamed "
            f"{cfg.lm_head.chunk_rows} rows a chunk (no full logits), weight where the model keeps it"]


def _why_left_alone(name: str, rows: int, cfg: MaximusConfig, frozen: bool = False) -> str:
    e = cfg.embedding
    if not e.enabled:
        return "embedding.enabled is false; set it true to swap it"
    if frozen and not e.modules and rows >= e.min_rows:
        return ("frozen (requires_grad=False, as PEFT's LoRA leaves the base model's weights), and maximus trains "
                "every row of a table it swaps; to train it, PEFT modules_to_save=['embed_tokens', ...] (maximus "
                "then swaps the trained copy)")
    if e.modules:
        return (f"not in embedding.modules {e.modules}; add \"{name}\" there to swap it")
    return (f"{rows} rows < embedding.min_rows={e.min_rows}; set \"min_rows\": {rows} (or list \"{name}\" in "
            f"\"embedding.modules\") in the maximus section to swap it")


def left_alone_lines(model: nn.Module, cfg: MaximusConfig) -> List[str]:
    """One line per large ``nn.Embedding`` (and the model's input embedding) still in the model, and why."""
    inputs = None
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            inputs = get()
        except (NotImplementedError, AttributeError):
            inputs = None
    lines = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Embedding):
            continue
        if m.num_embeddings < LARGE_ROWS and m is not inputs:
            continue
        why = ("the frozen original beside the trained copy its wrapper calls (PEFT modules_to_save), which maximus "
               "swaps instead" if bypassed_original(model, name, m)
               else _why_left_alone(name, m.num_embeddings, cfg, frozen=not m.weight.requires_grad))
        lines.append(f"ds_maximus: left alone: {name} ({m.num_embeddings} rows x {m.embedding_dim}): " + why)
    return lines


def log_wiring(model: nn.Module, modules: Dict[str, nn.Module], tied_heads: Dict[str, str],
               cfg: MaximusConfig) -> List[str]:
    """Print :func:`swapped_lines` and :func:`left_alone_lines` on rank 0; returns them (every rank).

    Printed, not logged, like the stats line: DeepSpeed's logger shows only warnings by default, and a set-up
    that swapped nothing must not pass unseen."""
    import torch.distributed as dist
    lines = (swapped_lines(modules, tied_heads, cfg) + streamed_head_line(model, modules, cfg)
             + left_alone_lines(model, cfg))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        for line in lines:
            print(line, flush=True)
    return lines
