"""Train a new tokenizer from a corpus (Hugging Face ``tokenizers``), as the source of a token map.

``maximus-tokenizer build`` calls this when no ``--tokenizer`` is given: the corpus that orders the
vocabulary also trains it. Two model types, as the common LLM families use them:

- ``bpe``: byte-level BPE (GPT-2, Llama 3, Qwen): every byte is in the vocabulary, so no text is
  ever unknown.
- ``unigram``: SentencePiece-style Unigram with the ``▁`` word-boundary marker (T5, Gemma, XLM-R).

The special tokens are ``unk``, ``bos``, ``eos`` and ``pad`` (ids 0-3, in that order) and ``bos`` is
put in front of every encoded text, as Llama's tokenizer does. The result is saved as a transformers
tokenizer folder (``tokenizer.json`` + ``tokenizer_config.json``) that ``AutoTokenizer`` loads.

Example::

    >>> from ds_maximus.tokenmap.train import train_tokenizer, save_tokenizer
    >>> tok = train_tokenizer(texts=["the cat sat on the mat"] * 50, vocab_size=300, progress=False)
    >>> tok.encode("the cat").tokens[0]
    '<s>'
    >>> import os, shutil, tempfile
    >>> d = tempfile.mkdtemp()
    >>> sorted(os.listdir(save_tokenizer(tok, os.path.join(d, "my_tokenizer"))))
    ['tokenizer.json', 'tokenizer_config.json']
    >>> shutil.rmtree(d)
"""
from __future__ import annotations

import enum
import os
from typing import Iterable, Iterator, Optional

from ds_maximus.errors import TokenMapError
from ds_maximus.tokenmap.corpus import corpus_stream

BYTE_ALPHABET_SIZE = 256  # a byte-level BPE starts from every byte value
SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


class TokenizerModel(str, enum.Enum):
    """The tokenizer model to train."""
    BPE = "bpe"
    UNIGRAM = "unigram"


def _progress(stream: Iterator[str], total_bytes: Optional[int], enabled: bool) -> Iterator[str]:
    """``stream`` with a progress bar over the bytes read (or the texts, when the size is unknown)."""
    if not enabled:
        yield from stream
        return
    from tqdm.auto import tqdm
    with tqdm(total=total_bytes, unit="B" if total_bytes else " texts", unit_scale=True,
              desc="training tokenizer: reading corpus") as bar:
        for t in stream:
            bar.update(len(t.encode()) if total_bytes else 1)
            yield t


def train_tokenizer(corpus=None, vocab_size: int = 32000, model: TokenizerModel = TokenizerModel.BPE, *,
                    texts: Optional[Iterable[str]] = None, text_key: str = "text", sample_by: str = "line",
                    min_frequency: int = 2, progress: bool = True):
    """A ``tokenizers.Tokenizer`` of at most ``vocab_size`` tokens trained on the corpus.

    ``corpus`` (text files or folders) and ``texts`` (literal strings) are read as by
    :func:`ds_maximus.tokenmap.corpus.corpus_stream`. ``min_frequency``: a BPE merge needs at least
    this many occurrences. The vocabulary is smaller than ``vocab_size`` when the corpus has fewer
    distinct pieces.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    try:
        model = TokenizerModel(model)
    except ValueError:
        raise TokenMapError(f"tokenizer model {model!r}; allowed: {[m.value for m in TokenizerModel]}") from None
    specials = list(SPECIAL_TOKENS.values())
    floor = len(specials) + (BYTE_ALPHABET_SIZE if model is TokenizerModel.BPE else 1)
    if not isinstance(vocab_size, int) or vocab_size < floor:
        raise TokenMapError(f"vocab_size={vocab_size!r} is too small for a {model.value} tokenizer: it needs at least "
                            f"{floor} (the {len(specials)} special tokens"
                            + (f" and the {BYTE_ALPHABET_SIZE} byte values)" if model is TokenizerModel.BPE else ")")
                            + "; pass a larger vocab_size")
    stream, total_bytes = corpus_stream(corpus, texts, text_key, sample_by)
    seen = {"chars": 0}

    def counted(ts):
        for t in ts:
            seen["chars"] += len(t.strip())
            yield t

    if model is TokenizerModel.BPE:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=progress)
    else:
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials,
                                          unk_token=SPECIAL_TOKENS["unk_token"], show_progress=progress)
    tok.train_from_iterator(counted(_progress(stream, total_bytes, progress)), trainer)
    if not seen["chars"]:
        raise TokenMapError("the corpus is empty: it holds no text to train a tokenizer on; pass non-empty text "
                            "files or strings")
    bos, eos = SPECIAL_TOKENS["bos_token"], SPECIAL_TOKENS["eos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {eos} $B",
        special_tokens=[(bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))])
    return tok


def save_tokenizer(tok, out_dir: str) -> str:
    """Save ``tok`` as a transformers tokenizer folder (``AutoTokenizer.from_pretrained(out_dir)``
    loads it); returns ``out_dir``."""
    from transformers import PreTrainedTokenizerFast
    os.makedirs(out_dir, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS).save_pretrained(out_dir)
    return out_dir
