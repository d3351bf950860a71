"""Corpus reading and token counting with a Hugging Face fast tokenizer.

A corpus is a list of text files or any iterable of strings. ``.jsonl`` files hold one JSON object
per line (the text in its ``text_key`` field); other files are split by ``sample_by`` as Hugging
Face ``datasets``' text loader does: ``"line"`` (each line, its newline kept), ``"paragraph"``
(blank-line separated blocks) or ``"document"`` (the whole file, in pieces of at most
:data:`DOC_PIECE_BYTES` cut at line ends). Counting encodes batches
with ``Tokenizer.encode_batch_fast`` (multithreaded in Rust) and accumulates with ``np.bincount``.
"""
from __future__ import annotations

import itertools
import json
import os
from typing import Iterable, Iterator, List, Optional, Sequence, Union

import numpy as np

from ds_maximus.errors import TokenMapError

Corpus = Union[str, os.PathLike, Iterable[str]]
SAMPLE_BY = ("line", "paragraph", "document")
DOC_PIECE_BYTES = 1 << 20  # "document" texts longer than this are encoded in pieces (bytes)


def _is_path(x) -> bool:
    return isinstance(x, (str, os.PathLike)) and os.path.exists(x)


def iter_texts(corpus: Union[Corpus, Sequence[Corpus]], text_key: str = "text",
               sample_by: str = "line") -> Iterator[str]:
    """Yield the texts of ``corpus``: a file, a folder of files, a list of files, or strings."""
    if sample_by not in SAMPLE_BY:
        raise TokenMapError(f"sample_by={sample_by!r}; allowed: {SAMPLE_BY}")
    if isinstance(corpus, (str, os.PathLike)):
        if not os.path.exists(corpus):
            raise TokenMapError(f"corpus file {corpus} does not exist; pass text files (.txt, .jsonl) or strings")
        corpus = [corpus]
    for item in corpus:
        if isinstance(item, os.PathLike) or (isinstance(item, str) and _is_path(item)):
            yield from _iter_file(os.fspath(item), text_key, sample_by)
        elif isinstance(item, str):
            yield item
        else:
            raise TokenMapError(f"corpus item of type {type(item).__name__}; allowed: str (a text or a file path)")


def _iter_file(path: str, text_key: str, sample_by: str) -> Iterator[str]:
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            if name.endswith((".txt", ".jsonl")):
                yield from _iter_file(os.path.join(path, name), text_key, sample_by)
        return
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)[text_key]
                    except (json.JSONDecodeError, KeyError, TypeError) as e:
                        raise TokenMapError(f"{path}:{n}: not a JSON object with a {text_key!r} string ({e}); "
                                            "fix the line or pass text_key=") from None
        elif sample_by == "line":
            yield from f
        else:
            yield from _group_lines(f, sample_by)


def _group_lines(lines: Iterable[str], sample_by: str) -> Iterator[str]:
    buf: List[str] = []
    size = 0
    for line in lines:
        if sample_by == "paragraph" and not line.strip():
            if buf:
                yield "".join(buf)
            buf, size = [], 0
            continue
        buf.append(line)
        size += len(line)
        if size >= DOC_PIECE_BYTES:
            yield "".join(buf)
            buf, size = [], 0
    if buf:
        yield "".join(buf)


def corpus_bytes(corpus) -> Optional[int]:
    """Total size of the corpus files (for a progress bar), or None for strings."""
    items = [corpus] if isinstance(corpus, (str, os.PathLike)) else corpus
    if not isinstance(items, (list, tuple)) or not all(_is_path(x) for x in items):
        return None
    total = 0
    for x in items:
        if os.path.isdir(x):
            total += sum(os.path.getsize(os.path.join(x, n)) for n in os.listdir(x) if n.endswith((".txt", ".jsonl")))
        else:
            total += os.path.getsize(x)
    return total


def encode_ids(tokenizer, texts: List[str]) -> np.ndarray:
    """All token ids of ``texts`` (no special tokens added), concatenated, as int64."""
    enc = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)(texts, add_special_tokens=False)
    n = sum(len(e.ids) for e in enc)
    return np.fromiter(itertools.chain.from_iterable(e.ids for e in enc), dtype=np.int64, count=n)


def count_tokens(tokenizer, corpus, vocab_size: int, batch_size: int = 1024, progress: bool = True,
                 text_key: str = "text", sample_by: str = "line") -> np.ndarray:
    """Frequency of every token id ``[0, vocab_size)`` over ``corpus`` (int64 array).

    Raises TokenMapError when the corpus holds no tokens at all.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    total_bytes = corpus_bytes(corpus)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=total_bytes, unit="B" if total_bytes else " texts", unit_scale=True, desc="counting tokens")
    texts = iter_texts(corpus, text_key, sample_by)
    try:
        while True:
            batch = list(itertools.islice(texts, batch_size))
            if not batch:
                break
            ids = encode_ids(tokenizer, batch)
            if ids.size and int(ids.max()) >= vocab_size:
                raise TokenMapError(f"the tokenizer produced id {int(ids.max())} >= vocab size {vocab_size}")
            counts += np.bincount(ids, minlength=vocab_size)
            if bar is not None:
                bar.update(sum(len(t.encode()) for t in batch) if total_bytes else len(batch))
    finally:
        if bar is not None:
            bar.close()
    if not counts.any():
        raise TokenMapError("the corpus is empty: it produced no tokens; pass non-empty text files or strings")
    return counts
