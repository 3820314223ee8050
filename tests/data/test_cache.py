"""The on-disk token cache is verified against its meta.json on every open: a damaged stream is never trained on."""

import json
import logging
import os

import numpy as np
import pytest

from lpt.data import cache as data_cache
from lpt.data import corpus


def _files(tmp_path):
    docs = {"a.txt": "alpha beta gamma\n" * 400, "b.txt": "delta épsilon\n" * 300}
    for name, text in docs.items():
        (tmp_path / name).write_text(text)
    return str(tmp_path / "*.txt")


def _streams(paths, cache_dir, tokenizer="bytes"):
    corpus._file_streams.cache_clear()  # each call opens the cache from disk, as a new process would
    c = corpus.load_corpus("text", paths, 0.1, cache_dir, tokenizer)
    return {s: np.asarray(v).copy() for s, v in c.streams.items()}, c.counts


def _cache_entry(cache_dir):
    (entry,) = [d for d in os.listdir(cache_dir) if ".tmp-" not in d and ".damaged-" not in d]
    return os.path.join(cache_dir, entry)


@pytest.fixture(params=["bytes", "bpe"])
def built(request, tmp_path, bpe512):
    tokenizer = "bytes" if request.param == "bytes" else bpe512
    paths, cache_dir = _files(tmp_path), str(tmp_path / "cache")
    streams, counts = _streams(paths, cache_dir, tokenizer)
    entry = _cache_entry(cache_dir)
    suffix = "u8" if tokenizer == "bytes" else "u16"
    return paths, cache_dir, tokenizer, streams, counts, os.path.join(entry, f"train.{suffix}")


def _rebuilt(built, caplog):
    paths, cache_dir, tokenizer, streams, counts, train = built
    with caplog.at_level(logging.WARNING, logger="lpt.data"):
        again, again_counts = _streams(paths, cache_dir, tokenizer)
    for split in streams:
        np.testing.assert_array_equal(again[split], streams[split])
        np.testing.assert_array_equal(again_counts[split], counts[split])
    return [r.getMessage() for r in caplog.records if "data cache is damaged" in r.getMessage()]


def test_a_truncated_stream_is_rebuilt_not_trained_on(built, caplog):
    train = built[-1]
    size = os.path.getsize(train)
    with open(train, "r+b") as fh:
        fh.truncate(1000)
    (warning,) = _rebuilt(built, caplog)
    assert f"{train} is 1000 bytes; its meta.json says {size} bytes" in warning and "rebuilding" in warning
    assert os.path.getsize(train) == size


def test_overwritten_bytes_of_the_same_size_are_caught_by_the_digest(built, caplog):
    train = built[-1]
    with open(train, "r+b") as fh:
        fh.seek(os.path.getsize(train) // 2)
        fh.write(b"\xff\xff")
    (warning,) = _rebuilt(built, caplog)
    assert "does not match the digest" in warning


def test_an_intact_cache_opens_without_a_warning_and_without_digest_is_checked_by_size(built, caplog):
    paths, cache_dir, tokenizer, streams, counts, train = built
    assert _rebuilt(built, caplog) == []
    meta_path = os.path.join(os.path.dirname(train), "meta.json")
    meta = json.load(open(meta_path))
    del meta["digest"]  # a cache written before digests existed
    json.dump(meta, open(meta_path, "w"))
    assert _rebuilt(built, caplog) == []
    with open(train, "ab") as fh:
        fh.write(b"\0\0")
    assert len(_rebuilt(built, caplog)) == 1


def test_the_digest_samples_a_large_file_and_sees_its_size(tmp_path, monkeypatch):
    monkeypatch.setattr(data_cache, "SAMPLE_BLOCKS", 4)
    monkeypatch.setattr(data_cache, "SAMPLE_BYTES", 8)
    path = tmp_path / "s.u8"
    data = bytearray(range(256)) * 4  # 1024 bytes; blocks at offsets 0, 338, 677, 1016
    path.write_bytes(bytes(data))
    d0 = data_cache.digest(str(path))
    data[340] ^= 1  # inside the second block
    path.write_bytes(bytes(data))
    assert data_cache.digest(str(path)) != d0
    data[340] ^= 1
    data[100] ^= 1  # between blocks: not read (the size check and the sampled blocks are the cheap part)
    path.write_bytes(bytes(data))
    assert data_cache.digest(str(path)) == d0
    path.write_bytes(bytes(data) + b"\0")
    assert data_cache.digest(str(path)) != d0
