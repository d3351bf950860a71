"""Corpus reading and token counting with a Hugging Face fast tokenizer.

A corpus comes in one of two explicit forms, never guessed one from the other: **files** (a path or
a sequence of paths, each a text file or a folder of ``.txt``/``.jsonl`` files; a path that does
not exist is a ``FileNotFoundError`` naming it) and **texts** (an iterable of strings, each taken
as literal text). ``.jsonl`` files hold one JSON object per line (the text in its ``text_key``
field); other files are split by ``sample_by`` as Hugging Face ``datasets``' text loader does:
``"line"`` (each line, its newline kept), ``"paragraph"`` (blank-line separated blocks) or
``"document"`` (the whole file, in pieces of at most :data:`DOC_PIECE_BYTES` cut at line ends).
Counting encodes batches with ``Tokenizer.encode_batch_fast`` (multithreaded in Rust) and
accumulates with ``np.bincount``.
"""
from __future__ import annotations

import errno
import itertools
import json
import os
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from ds_maximus.errors import TokenMapError

PathLike = Union[str, os.PathLike]
SAMPLE_BY = ("line", "paragraph", "document")
TEXT_SUFFIXES = (".txt", ".jsonl")
DOC_PIECE_BYTES = 1 << 20  # "document" texts longer than this are encoded in pieces (bytes)


def corpus_files(corpus: Union[PathLike, Sequence[PathLike]]) -> List[str]:
    """The text files of ``corpus``: a path or a sequence of paths, folders expanded to their
    ``.txt``/``.jsonl`` files (sorted by name).

    Raises ``FileNotFoundError`` naming the first path that does not exist, and ``TokenMapError``
    for an item that is not a path or a folder that holds no text file.
    """
    items = [corpus] if isinstance(corpus, (str, os.PathLike)) else list(corpus)
    files: List[str] = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise TokenMapError(f"corpus item of type {type(item).__name__}; allowed: a file or folder path "
                                "(literal text goes in texts=)")
        path = os.fspath(item)
        if not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, "corpus path does not exist (pass existing .txt or .jsonl files "
                                    "or folders of them; from Python, literal text goes in texts=)", path)
        if os.path.isdir(path):
            found = [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(TEXT_SUFFIXES)]
            if not found:
                raise TokenMapError(f"corpus folder {path} holds no {' or '.join(TEXT_SUFFIXES)} file; "
                                    "put the text files there or name them directly")
            files += found
        else:
            files.append(path)
    return files


def _check_sample_by(sample_by: str) -> None:
    if sample_by not in SAMPLE_BY:
        raise TokenMapError(f"sample_by={sample_by!r}; allowed: {SAMPLE_BY}")


def iter_texts(corpus: Union[PathLike, Sequence[PathLike]], text_key: str = "text",
               sample_by: str = "line") -> Iterator[str]:
    """The texts of the files of ``corpus`` (see :func:`corpus_files`); the paths are checked at once."""
    _check_sample_by(sample_by)
    files = corpus_files(corpus)
    return itertools.chain.from_iterable(_iter_file(f, text_key, sample_by) for f in files)


def literal_texts(texts: Iterable[str]) -> Iterator[str]:
    """``texts`` as given (one string is one text), each checked to be a string."""
    if isinstance(texts, str):
        texts = [texts]
    for t in texts:
        if not isinstance(t, str):
            raise TokenMapError(f"texts= item of type {type(t).__name__}; allowed: str (file paths go in corpus=)")
        yield t


def _iter_file(path: str, text_key: str, sample_by: str) -> Iterator[str]:
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


def encode_ids(tokenizer, texts: List[str]) -> np.ndarray:
    """All token ids of ``texts`` (no special tokens added), concatenated, as int64."""
    enc = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)(texts, add_special_tokens=False)
    n = sum(len(e.ids) for e in enc)
    return np.fromiter(itertools.chain.from_iterable(e.ids for e in enc), dtype=np.int64, count=n)


def corpus_stream(corpus=None, texts: Optional[Iterable[str]] = None, text_key: str = "text",
                  sample_by: str = "line") -> Tuple[Iterator[str], Optional[int]]:
    """(the texts of ``texts`` then of the files of ``corpus``, the files' byte count for a progress
    bar or None when literal texts are part of the stream). At least one of the two must be given."""
    if corpus is None and texts is None:
        raise TokenMapError("no corpus given; pass corpus= (text files or folders) or texts= (strings of text)")
    files = corpus_files(corpus) if corpus is not None else []
    stream = iter_texts(files, text_key, sample_by)
    if texts is None:
        return stream, sum(os.path.getsize(f) for f in files)
    return itertools.chain(literal_texts(texts), stream), None


def count_tokens(tokenizer, texts: Iterable[str], vocab_size: int, batch_size: int = 1024, progress: bool = True,
                 total_bytes: Optional[int] = None) -> np.ndarray:
    """Frequency of every token id ``[0, vocab_size)`` over ``texts`` (int64 array); ``total_bytes``
    (the UTF-8 size of all texts, when known) makes the progress bar count bytes instead of texts.

    Raises TokenMapError when the texts hold no tokens at all.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=total_bytes, unit="B" if total_bytes else " texts", unit_scale=True, desc="counting tokens")
    texts = iter(texts)
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
