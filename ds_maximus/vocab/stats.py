"""Per-step and cumulative statistics of a ``ShardedEmbedding`` (hit rate, traffic, stall, sparsity).

Hit rate: of the unique rows each batch asks for, those already in the GPU cache when first asked for
(by ``prefetch`` when the batch was prefetched, else by the lookup). Traffic counts rows and bytes moved
between the cache and its tier; stall is the time the compute stream waited for fills. Overflow counts the
rows of batches too large for the cache that were served from the tier directly (``overflow_rows``) and the
lookups that did so (``overflow_batches``).
"""
from __future__ import annotations

import dataclasses
from typing import Dict

FIELDS = ("lookups", "hits", "rows_fetched", "rows_evicted", "bytes_h2d", "bytes_d2h", "stall_ms",
          "touched_rows", "overflow_rows", "overflow_batches")


@dataclasses.dataclass
class EmbeddingStats:
    """Snapshots of the cache counters at each optimizer step; ``stats()`` turns them into rates."""

    num_rows: int
    steps: int = 0
    touched_rows_total: int = 0
    last_touched: int = 0
    _prev: Dict[str, float] = dataclasses.field(default_factory=dict)
    _last: Dict[str, float] = dataclasses.field(default_factory=dict)

    def snapshot(self, cache) -> Dict[str, float]:
        c, t = cache.counters, cache.traffic
        return {"lookups": c.lookups, "hits": c.hits, "rows_fetched": t.rows_fetched,
                "rows_evicted": t.rows_evicted, "bytes_h2d": t.bytes_h2d, "bytes_d2h": t.bytes_d2h,
                "stall_ms": t.stall_ms, "overflow_rows": t.overflow_rows, "overflow_batches": t.overflow_batches}

    def end_step(self, cache, touched_rows: int) -> None:
        cache.resolve_stalls()
        now = self.snapshot(cache)
        self._last = {k: now[k] - self._prev.get(k, 0) for k in now}
        self._prev = now
        self.steps += 1
        self.last_touched = int(touched_rows)
        self.touched_rows_total += int(touched_rows)

    def as_dict(self, cache) -> dict:
        cache.resolve_stalls()
        now = self.snapshot(cache)
        out = _rates(now, self.touched_rows_total / max(1, self.steps), self.num_rows)
        out["steps"] = self.steps
        out["last_step"] = _rates(self._last, self.last_touched, self.num_rows) if self._last else {}
        return out


def _rates(d: Dict[str, float], touched: float, num_rows: int) -> dict:
    lookups = d.get("lookups", 0)
    return {"hit_rate": d.get("hits", 0) / lookups if lookups else 0.0,
            "lookups": int(lookups),
            "rows_fetched": int(d.get("rows_fetched", 0)), "rows_evicted": int(d.get("rows_evicted", 0)),
            "bytes_h2d": int(d.get("bytes_h2d", 0)), "bytes_d2h": int(d.get("bytes_d2h", 0)),
            "stall_ms": float(d.get("stall_ms", 0.0)),
            "overflow_rows": int(d.get("overflow_rows", 0)), "overflow_batches": int(d.get("overflow_batches", 0)),
            "row_sparsity": touched / num_rows if num_rows else 0.0}


def format_line(name: str, step: int, s: dict) -> str:
    last = s.get("last_step") or s
    return (f"{name} step {step}: hit {last['hit_rate']:.1%} (cum {s['hit_rate']:.1%}), fetched "
            f"{last['rows_fetched']} evicted {last['rows_evicted']} rows, H2D {last['bytes_h2d'] / 2**20:.1f} MiB "
            f"D2H {last['bytes_d2h'] / 2**20:.1f} MiB, stall {last['stall_ms']:.2f} ms, touched "
            f"{last['row_sparsity']:.2%} of rows" + (f", overflow {last['overflow_rows']} rows served from the tier"
                                                     if last.get("overflow_rows") else ""))
