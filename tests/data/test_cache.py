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
    assert "does not match the full digest" in warning


def test_a_tokenizer_caches_counts_are_checked_too(built, caplog):
    counts = os.path.join(os.path.dirname(built[-1]), "counts.npy")
    if built[2] == "bytes":
        assert not os.path.exists(counts)  # the bytes cache keeps its counts in meta.json
        return
    table = np.load(counts)
    table[0, 5] += 1
    np.save(counts, table)
    (warning,) = _rebuilt(built, caplog)
    assert f"{counts} does not match the full digest" in warning


def test_a_missing_meta_json_is_damage(built, caplog):
    os.remove(os.path.join(os.path.dirname(built[-1]), "meta.json"))
    (warning,) = _rebuilt(built, caplog)
    assert "meta.json is missing" in warning and "rebuilding" in warning


def test_an_intact_cache_opens_without_a_warning(built, caplog):
    assert _rebuilt(built, caplog) == []
    assert _rebuilt(built, caplog) == []


def _sampled_blocks(size):
    """The byte ranges the sampled digest reads (``data_cache.digest``)."""
    starts = np.linspace(0, size - data_cache.SAMPLE_BYTES, data_cache.SAMPLE_BLOCKS).astype(np.int64)
    return [(int(a), int(a) + data_cache.SAMPLE_BYTES) for a in starts]


def test_overwritten_bytes_between_the_sampled_blocks_are_caught(tmp_path, caplog):
    """2,000 bytes overwritten outside the 64 sampled 4 KiB blocks of a 912 KB stream: the sampled digest does not
    change, the full digest does; the cache is removed with a warning naming the file and rebuilt."""
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(20_000)).encode()
    (tmp_path / "big.txt").write_bytes(text[:1_013_000])
    paths, cache_dir = str(tmp_path / "*.txt"), str(tmp_path / "cache")
    streams, counts = _streams(paths, cache_dir)
    train = os.path.join(_cache_entry(cache_dir), "train.u8")
    size = os.path.getsize(train)
    assert 900_000 < size < 920_000
    blocks = _sampled_blocks(size)
    start = blocks[10][1] + 100  # in the gap after the 11th sampled block
    assert start + 2000 <= blocks[11][0]
    sampled = data_cache.digest(train)
    with open(train, "r+b") as fh:
        fh.seek(start)
        fh.write(b"#" * 2000)
    assert data_cache.digest(train) == sampled  # what the sampled check alone lets through
    (warning,) = _rebuilt((paths, cache_dir, "bytes", streams, counts, train), caplog)
    assert f"{train} does not match the full digest in its meta.json" in warning and "rebuilding" in warning
    with open(train, "rb") as fh:
        fh.seek(start)
        assert fh.read(2000) == streams["train"][start : start + 2000].tobytes()


def test_a_cache_without_a_full_digest_is_rebuilt_once(built, caplog):
    """A cache written by an older lpt (meta.json with the sampled digest only) cannot be verified byte for byte:
    it is rebuilt once, with a warning saying why, and opens silently afterwards."""
    paths, cache_dir, tokenizer, streams, counts, train = built
    meta_path = os.path.join(os.path.dirname(train), "meta.json")
    meta = json.load(open(meta_path))
    del meta["full_digest"], meta["inputs"]
    json.dump(meta, open(meta_path, "w"))
    with caplog.at_level(logging.WARNING, logger="lpt.data"):
        again, _ = _streams(paths, cache_dir, tokenizer)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "written by an older lpt without a full digest" in warning and os.path.dirname(train) in warning
    assert "rebuilding" in warning
    assert {s: a.tobytes() for s, a in again.items()} == {s: a.tobytes() for s, a in streams.items()}
    assert "full_digest" in json.load(open(meta_path))
    caplog.clear()
    assert _rebuilt(built, caplog) == []


def test_the_full_digest_sees_every_byte_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(data_cache, "DIGEST_CHUNK", 1000)  # 10 chunks, hashed on parallel threads
    data = bytearray(np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes())
    path = tmp_path / "s.u8"
    path.write_bytes(bytes(data))
    d0 = data_cache.full_digest(str(path))
    assert d0 == data_cache.full_digest(np.frombuffer(bytes(data), np.uint8))  # file and buffer: one digest
    for i in (0, 999, 1000, 5432, 9999):
        data[i] ^= 1
        path.write_bytes(bytes(data))
        assert data_cache.full_digest(str(path)) != d0, i
        data[i] ^= 1
    path.write_bytes(bytes(data) + b"\0")
    assert data_cache.full_digest(str(path)) != d0
    path.write_bytes(bytes(data))
    assert data_cache.full_digest(str(path)) == d0


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
    data[100] ^= 1  # between blocks: not read (what full_digest is for)
    path.write_bytes(bytes(data))
    assert data_cache.digest(str(path)) == d0
    path.write_bytes(bytes(data) + b"\0")
    assert data_cache.digest(str(path)) != d0


@pytest.mark.parametrize("where", ["file", "under_a_file", "proc"])
def test_a_cache_dir_that_cannot_hold_a_cache_is_one_clear_error(where, tmp_path):
    paths = _files(tmp_path)
    (tmp_path / "plain").write_text("not a directory")
    cache_dir, why = {
        "file": (str(tmp_path / "plain"), "it is a file, not a directory"),
        "under_a_file": (str(tmp_path / "plain" / "cache"), "a part of its path is a file, not a directory"),
        "proc": ("/proc/lpt-cache", "it cannot be created (No such file or directory)"),
    }[where]
    corpus._file_streams.cache_clear()
    with pytest.raises(ValueError) as e:
        corpus.load_corpus("text", paths, 0.1, cache_dir)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"data.cache_dir={cache_dir!r} cannot hold the token cache: {why}")
    assert (tmp_path / "plain").read_text() == "not a directory"


def test_an_unusable_cache_dir_from_the_environment_is_named_as_such(tmp_path, monkeypatch):
    monkeypatch.setenv("LPT_DATA_CACHE", "/proc/lpt-cache")
    corpus._file_streams.cache_clear()
    with pytest.raises(ValueError, match=r"^\$LPT_DATA_CACHE \(data.cache_dir is unset\)='/proc/lpt-cache' cannot"):
        corpus.load_corpus("text", _files(tmp_path), 0.1)
