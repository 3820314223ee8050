"""corpus_identity / corpus_changes: a resumed run can tell whether the corpus behind the same data.paths changed
(a file added, deleted or edited), and an identical corpus, also one copied elsewhere, compares equal."""

import json
import os
import shutil
import sys

import pytest

import lpt.data as D
from lpt.data import corpus, prepare


def _ident(cfg):
    corpus._file_streams.cache_clear()  # as a new process would: the cache is opened from disk
    ident = D.corpus_identity(cfg)
    assert json.loads(json.dumps(ident)) == ident  # storable in a checkpoint's metadata as it is
    return ident


def _write(directory, names=("a.txt", "b.txt", "c.txt", "d.txt")):
    directory.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        (directory / name).write_text(f"document {name}: " + "some words of text\n" * (50 + 10 * i))
    return str(directory / "*.txt")


@pytest.fixture(params=["bytes", "bpe"])
def text_cfg(request, tmp_path, bpe512):
    tokenizer = "bytes" if request.param == "bytes" else bpe512
    paths, cache_dir = _write(tmp_path / "in"), str(tmp_path / "cache")
    return {"source": "text", "paths": paths, "cache_dir": cache_dir, "tokenizer": tokenizer}


def test_an_unchanged_corpus_has_the_same_identity(text_cfg, tmp_path):
    saved = _ident(text_cfg)
    assert sorted(saved["files"]) == ["a.txt", "b.txt", "c.txt", "d.txt"]
    assert saved["files"]["a.txt"]["size"] == os.path.getsize(tmp_path / "in" / "a.txt")
    assert _ident(text_cfg) == saved and D.corpus_changes(saved, _ident(text_cfg)) == []
    # the same files copied elsewhere (new paths, new mtimes, a new cache): the same corpus
    shutil.copytree(tmp_path / "in", tmp_path / "copy", copy_function=shutil.copyfile)
    moved = _ident({**text_cfg, "paths": str(tmp_path / "copy" / "*.txt"), "cache_dir": str(tmp_path / "cache2")})
    assert D.corpus_changes(saved, moved) == [] and moved == saved


def test_added_deleted_and_edited_files_are_named(text_cfg, tmp_path):
    saved = _ident(text_cfg)
    _write(tmp_path / "in", ["e.txt"])
    for name in ("a.txt", "b.txt", "c.txt"):
        os.remove(tmp_path / "in" / name)
    changes = D.corpus_changes(saved, _ident(text_cfg))
    assert changes[:4] == ["file e.txt added", "file a.txt deleted", "file b.txt deleted", "file c.txt deleted"]
    tokens = {s: saved["streams"][s]["tokens"] for s in ("train", "validation")}
    assert changes[4].startswith(f"train tokens {tokens['train']} -> ") and len(changes) == 6


def test_an_edit_of_the_same_size_and_a_longer_file(text_cfg, tmp_path):
    saved = _ident(text_cfg)
    path = tmp_path / "in" / "b.txt"
    path.write_bytes(path.read_bytes().replace(b"some", b"more", 1))  # same size, new content
    changes = D.corpus_changes(saved, _ident(text_cfg))
    assert changes[0] == "b.txt: content changed (same size)"
    assert changes[1].startswith("train tokens ")  # the same count (bytes) or a new one (BPE): the tokens differ
    with open(path, "ab") as fh:
        fh.write(b"one more line\n")
    size = saved["files"]["b.txt"]["size"]
    assert D.corpus_changes(saved, _ident(text_cfg))[0] == f"b.txt: size {size} -> {size + 14}"


def test_the_identity_reuses_the_cache_and_reads_no_input(text_cfg, monkeypatch):
    saved = _ident(text_cfg)
    corpus._file_streams.cache_clear()
    monkeypatch.setattr(D.cache, "digest", lambda path: pytest.fail(f"{path} hashed again"))
    assert D.corpus_identity(text_cfg) == saved  # the inputs' digests come from the cache's meta.json


# train tokens of the embedded corpus (this Python's pydoc_data.topics, bytes tokenizer) on the Pythons .ci/run tests
EMBEDDED_TRAIN_TOKENS = {(3, 11): 336_675, (3, 13): 373_538}


def test_embedded_and_prepared_sources(tmp_path, bpe512):
    emb = _ident({"source": "embedded"})
    tokens = emb["streams"]["train"]["tokens"]
    assert list(emb["files"]) == ["pydoc_data.topics"] and tokens > 300_000
    assert tokens == EMBEDDED_TRAIN_TOKENS.get(sys.version_info[:2], tokens)
    assert D.corpus_changes(emb, _ident({"source": "embedded"})) == []
    bpe = _ident({"source": "embedded", "tokenizer": bpe512})
    assert D.corpus_changes(emb, bpe)[0] == f"tokenizer 'bytes' -> {bpe['tokenizer']!r}"

    glob = _write(tmp_path / "in")
    prepare.prepare(bpe512, glob, str(tmp_path / "prep"), progress=False)
    cfg = {"source": "prepared", "paths": str(tmp_path / "prep"), "tokenizer": bpe512}
    saved = _ident(cfg)
    assert sorted(saved["files"]) == ["a.txt", "b.txt", "c.txt", "d.txt"] and saved["tokenizer"] == bpe["tokenizer"]
    assert all(saved["streams"][s]["digest"] for s in ("train", "validation")) and _ident(cfg) == saved
    text = _ident({"source": "text", "paths": glob, "cache_dir": str(tmp_path / "cache"), "tokenizer": bpe512})
    assert {s: saved["streams"][s]["tokens"] for s in text["streams"]} == {
        s: text["streams"][s]["tokens"] for s in text["streams"]
    }  # the same tokens as the on-the-fly path
    shutil.rmtree(tmp_path / "prep")  # prepared again, from one more file
    _write(tmp_path / "in", ["e.txt"])
    prepare.prepare(bpe512, glob, str(tmp_path / "prep"), progress=False)
    changes = D.corpus_changes(saved, _ident(cfg))
    assert changes[0] == "file e.txt added" and changes[1].startswith("train tokens ")


def test_corpus_changes_refuses_what_is_not_an_identity():
    ident = _ident({"source": "embedded"})
    with pytest.raises(ValueError, match=r"^the saved corpus identity is not one corpus_identity returns"):
        D.corpus_changes({"files": {}}, ident)
    other = {**ident, "version": 2}
    assert D.corpus_changes(ident, other) == ["corpus identity format 1 -> 2"]
