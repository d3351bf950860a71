"""Corpus input: files and literal texts are two explicit forms; a path that does not exist is an error."""
import json
import os

import pytest

from ds_maximus.errors import TokenMapError
from ds_maximus.tokenmap import TokenMap
from ds_maximus.tokenmap.cli import main
from ds_maximus.tokenmap.corpus import corpus_files, corpus_stream, iter_texts


def test_missing_path_is_file_not_found_naming_it(tmp_path, tiny_tokenizer_dir, corpus_file):
    typo = str(tmp_path / "typo.txt")
    with pytest.raises(FileNotFoundError, match="typo.txt") as e:
        TokenMap.build(tiny_tokenizer_dir, typo, progress=False)
    assert e.value.filename == typo
    # one bad path among good ones is not skipped either
    with pytest.raises(FileNotFoundError, match="typo.txt"):
        TokenMap.build(tiny_tokenizer_dir, [corpus_file, typo], progress=False)
    with pytest.raises(FileNotFoundError, match="typo.txt"):
        iter_texts([typo])  # checked at the call, not at the first next()


def test_cli_build_and_inspect_refuse_a_missing_corpus(tmp_path, capsys, tiny_tokenizer_dir, token_map_dir):
    typo = str(tmp_path / "data" / "typo.txt")
    for argv in (["build", "--tokenizer", tiny_tokenizer_dir, "--corpus", typo, "--out", str(tmp_path / "tm")],
                 ["build", "--corpus", typo, "--vocab-size", "300", "--out", str(tmp_path / "tm")],
                 ["inspect", "--token-map", token_map_dir, "--corpus", typo]):
        assert main([*argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error:") and typo in err and "does not exist" in err
        assert not os.path.exists(tmp_path / "tm")  # nothing written


def test_strings_are_never_read_as_paths(tmp_path, tiny_tokenizer_dir, corpus_file):
    # a literal text that happens to name an existing file is counted as that text
    a = TokenMap.build(tiny_tokenizer_dir, texts=[corpus_file], progress=False)
    assert a.meta["corpus_tokens"] == len(a.encode(corpus_file))
    # and texts= takes one string as one text, not as its characters or a path
    b = TokenMap.build(tiny_tokenizer_dir, texts=corpus_file, progress=False)
    assert b.meta["corpus_tokens"] == a.meta["corpus_tokens"]
    with pytest.raises(TokenMapError, match="texts= item of type int"):
        TokenMap.build(tiny_tokenizer_dir, texts=["ok", 3], progress=False)
    with pytest.raises(TokenMapError, match="corpus item of type int"):
        TokenMap.build(tiny_tokenizer_dir, [corpus_file, 3], progress=False)
    with pytest.raises(TokenMapError, match="no corpus given"):
        TokenMap.build(tiny_tokenizer_dir, progress=False)


def test_files_and_texts_together(tmp_path, tiny_tokenizer_dir, corpus_file):
    extra = ["def f(x):\n", "    return x\n"]
    both = TokenMap.build(tiny_tokenizer_dir, [corpus_file], texts=extra, progress=False)
    files = TokenMap.build(tiny_tokenizer_dir, [corpus_file], progress=False)
    texts = TokenMap.build(tiny_tokenizer_dir, texts=extra, progress=False)
    assert both.meta["corpus_tokens"] == files.meta["corpus_tokens"] + texts.meta["corpus_tokens"]
    stream, total = corpus_stream([corpus_file])
    assert total == os.path.getsize(corpus_file) and next(stream)
    assert corpus_stream([corpus_file], texts=extra)[1] is None  # literal texts: the bar counts texts


def test_folders(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "b.txt").write_text("second\n")
    (d / "a.jsonl").write_text(json.dumps({"text": "first"}) + "\n")
    (d / "notes.md").write_text("not a corpus file\n")
    assert corpus_files(str(d)) == [str(d / "a.jsonl"), str(d / "b.txt")]
    assert list(iter_texts(d)) == ["first", "second\n"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenMapError, match="holds no .txt or .jsonl file"):
        corpus_files(str(tmp_path / "empty"))
