"""``inspect_token_map``: sizes, shards, top tokens and coverage of a token map (and its store)."""
from __future__ import annotations

from typing import Optional, Sequence

from ds_maximus.store import ShardStore
from ds_maximus.tokenmap.token_map import TokenMap

DEFAULT_KS = (256, 1024, 4096, 16384, 65536, 262144)


def inspect_token_map(token_map, store: Optional[str] = None, corpus=None, ks: Optional[Sequence[int]] = None,
                      top: int = 20, text_key: str = "text", progress: bool = False, sample_by: str = "line") -> dict:
    """A report dict: ``sizes``, ``store`` (shards), ``top_tokens``, ``coverage`` ({k: share} of the
    build corpus's tokens in the first k rows) and, with ``corpus``, ``corpus_coverage`` on it."""
    tm = token_map if isinstance(token_map, TokenMap) else TokenMap.load(token_map)
    V = tm.vocab_size
    ks = sorted({min(int(k), V) for k in (ks or [k for k in DEFAULT_KS if k < V] + [V])})
    out = {"sizes": {"vocab_size": V, "base_vocab_size": tm.base_vocab_size, "num_special": tm.num_special,
                     "extended_tokens": len(tm.meta.get("extended_tokens", [])),
                     "corpus_tokens": int(tm.meta.get("corpus_tokens", 0)),
                     "tokens_seen": int((tm.counts > 0).sum())},
           "top_tokens": [{"id": i, "token": t, "count": c} for i, t, c in tm.top_tokens(top)],
           "coverage": {k: tm.coverage(k) for k in ks}}
    if store is not None:
        s = store if isinstance(store, ShardStore) else ShardStore.open(store, loader=False)
        out["store"] = {"path": s.path, "vocab_size": s.vocab_size, "dim": s.dim, "dtype": str(s.dtype),
                        "rows_per_shard": s.rows_per_shard, "num_shards": s.num_shards,
                        "state_names": list(s.state_names),
                        "bytes": sum(s.shard_info(i).bytes for i in range(s.num_shards)),
                        "matches_token_map": s.vocab_size == V,
                        "shards": [{"id": i, "rows": list(s.shard_range(i)), "bytes": s.shard_info(i).bytes,
                                    "corpus_share": tm.coverage(s.shard_range(i)[1]) - tm.coverage(s.shard_range(i)[0])}
                                   for i in range(s.num_shards)]}
    if corpus is not None:
        out["corpus_coverage"] = tm.corpus_coverage(corpus, ks, text_key=text_key, progress=progress,
                                                     sample_by=sample_by)
    return out


def format_report(rep: dict) -> str:
    """The report as readable text (markdown-ish tables)."""
    lines = ["## sizes"] + [f"- {k}: {v}" for k, v in rep["sizes"].items()]
    if "store" in rep:
        s = rep["store"]
        lines += ["", "## store", f"- {s['path']}: {s['num_shards']} shards x {s['rows_per_shard']} rows, "
                  f"dim {s['dim']}, {s['dtype']}, states {s['state_names'] or '-'}, {s['bytes'] / 2**20:.1f} MiB, "
                  f"matches token map: {s['matches_token_map']}",
                  "", "| shard | rows | MiB | share of corpus tokens |", "|---|---|---|---|"]
        lines += [f"| {x['id']} | [{x['rows'][0]}, {x['rows'][1]}) | {x['bytes'] / 2**20:.2f} "
                  f"| {x['corpus_share']:.4f} |" for x in s["shards"]]
    lines += ["", "## coverage (share of corpus tokens in rows [0, K))", "| K | build corpus |"
              + (" given corpus |" if "corpus_coverage" in rep else ""),
              "|---|---|" + ("---|" if "corpus_coverage" in rep else "")]
    for k, v in rep["coverage"].items():
        row = f"| {k} | {v:.4f} |"
        if "corpus_coverage" in rep:
            row += f" {rep['corpus_coverage'][k]:.4f} |"
        lines.append(row)
    lines += ["", "## top tokens", "| id | token | count |", "|---|---|---|"]
    lines += [f"| {t['id']} | {t['token']!r} | {t['count']} |" for t in rep["top_tokens"]]
    return "\n".join(lines)
