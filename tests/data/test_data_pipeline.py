"""Data: determinism, split disjointness, per-process shards, iterator state round trip, errors, unigram."""

import json
import os
import pickle

import numpy as np
import pytest

import lpt.data as D
from lpt.data import corpus
from lpt.data import documents as data_documents

CFG = {"source": "embedded", "validation_fraction": 0.1, "shuffle_seed": 0}


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_train_batches_are_deterministic_and_seeded():
    a = _take(D.make_train_iterator(CFG, seq_len=32, global_batch=4, seed=1), 3)
    b = _take(D.make_train_iterator(CFG, seq_len=32, global_batch=4, seed=1), 3)
    c = _take(D.make_train_iterator(CFG, seq_len=32, global_batch=4, seed=2), 3)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    assert any((x["inputs"] != z["inputs"]).any() for x, z in zip(a, c, strict=True))
    x = a[0]
    assert x["inputs"].dtype == np.int32 and x["inputs"].shape == (4, 32)
    np.testing.assert_array_equal(x["inputs"][:, 1:], x["targets"][:, :-1])  # targets are inputs shifted by one


def test_windows_pack_the_stream_with_separators():
    stream = D.load_corpus("embedded", None, 0.1).streams["train"]
    n_pieces = sum(len(d) - round(0.1 * len(d)) > 0 for _, d in D.load_documents("embedded"))
    assert int((stream == corpus.SEPARATOR).sum()) == n_pieces > 70  # one separator after every document piece
    w = D.Windows(stream, 32)
    np.testing.assert_array_equal(w[3], stream[96:129])
    assert len(w) == (stream.size - 1) // 32


def test_split_is_disjoint_and_proportional():
    docs = D.load_documents("embedded")
    s = D.load_corpus("embedded", None, 0.1).streams
    n_text = sum(len(d) for _, d in docs)
    n_val = int((s["validation"] != corpus.SEPARATOR).sum())
    n_train = int((s["train"] != corpus.SEPARATOR).sum())
    assert n_val + n_train == n_text
    assert abs(n_val / n_text - 0.1) < 0.002
    # every validation document piece is the tail of its document and not in train
    train = s["train"].tobytes()
    tails = s["validation"].tobytes().split(b"\0")[:-1]
    long_tails = [t for t in tails if len(t) > 200]
    assert len(long_tails) > 20
    assert not any(t in train for t in long_tails)


@pytest.mark.parametrize("procs", [2, 4])
def test_process_shards_are_disjoint_and_cover_the_global_batch(procs):
    whole = _take(D.make_train_iterator(CFG, seq_len=16, global_batch=8, seed=0), 3)
    parts = [
        _take(D.make_train_iterator(CFG, seq_len=16, global_batch=8, process_index=p, process_count=procs, seed=0), 3)
        for p in range(procs)
    ]
    for step in range(3):
        stacked = np.concatenate([parts[p][step]["inputs"] for p in range(procs)])
        np.testing.assert_array_equal(stacked, whole[step]["inputs"])
        assert len({r.tobytes() for r in stacked}) == 8


def test_an_iterator_started_at_a_batch_continues_any_other():
    """start=b yields what an iterator that already gave b batches yields next, for another process count too (the
    trainer resumes step b this way, whatever the process or worker count was)."""
    it = D.make_train_iterator(CFG, seq_len=16, global_batch=4, seed=3)
    _take(it, 5)
    expected = _take(it, 3)
    resumed = _take(D.make_train_iterator(CFG, seq_len=16, global_batch=4, seed=3, start=5), 3)
    halves = [
        _take(
            D.make_train_iterator(CFG, seq_len=16, global_batch=4, seed=3, start=5, process_index=p, process_count=2), 3
        )
        for p in range(2)
    ]
    for i in range(3):
        np.testing.assert_array_equal(resumed[i]["inputs"], expected[i]["inputs"])
        np.testing.assert_array_equal(np.concatenate([h[i]["inputs"] for h in halves]), expected[i]["inputs"])
    assert (
        expected[0]["inputs"] != _take(D.make_train_iterator(CFG, seq_len=16, global_batch=4, seed=3), 1)[0]["inputs"]
    ).any()
    with pytest.raises(ValueError, match="start=-1 must be an int >= 0"):
        D.make_train_iterator(CFG, seq_len=16, global_batch=4, start=-1)


def test_iterator_state_round_trip_resumes_exactly():
    it = D.make_train_iterator(CFG, seq_len=16, global_batch=4, seed=3)
    _take(it, 5)
    state = json.loads(json.dumps(it.get_state()))
    expected = _take(it, 4)
    fresh = D.make_train_iterator(CFG, seq_len=16, global_batch=4, seed=3)
    fresh.set_state(state)
    for x, y in zip(_take(fresh, 4), expected, strict=True):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    first = next(D.make_train_iterator(CFG, seq_len=16, global_batch=4, seed=3))
    assert (first["inputs"] != expected[0]["inputs"]).any()


def test_eval_batches_deterministic_from_validation_split():
    a = D.make_eval_batches(CFG, seq_len=32, batch=4, num_batches=2)
    b = D.make_eval_batches(CFG, seq_len=32, batch=4, num_batches=2, process_index=1, process_count=2)
    val = D.load_corpus("embedded", None, 0.1).streams["validation"]
    np.testing.assert_array_equal(a[0]["inputs"][0], val[:32])
    np.testing.assert_array_equal(b[1]["inputs"], a[1]["inputs"][2:])
    with pytest.raises(ValueError, match="has only"):
        D.make_eval_batches(CFG, seq_len=512, batch=64, num_batches=10)


def test_unigram_loss_is_the_byte_entropy_baseline():
    loss = D.unigram_loss(CFG)
    # English text bytes: ~4.3-4.8 bits per byte -> ~3.0-3.4 nats; a uniform model would be ln 256 = 5.55
    assert 2.9 < loss < 3.5
    assert D.unigram_loss(CFG, split="train") < loss  # in-sample is lower


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="matches no files"):
        D.make_train_iterator({"source": "text", "paths": str(tmp_path / "*.txt")}, seq_len=8, global_batch=2)
    with pytest.raises(ValueError, match="needs a glob"):
        D.make_train_iterator({"source": "text"}, seq_len=8, global_batch=2)
    with pytest.raises(ValueError, match="source='hdfs'.*allowed"):
        D.make_train_iterator({"source": "hdfs"}, seq_len=8, global_batch=2)
    with pytest.raises(ValueError, match="not divisible by the process count 3"):
        D.make_train_iterator(CFG, seq_len=8, global_batch=8, process_count=3)
    with pytest.raises(
        ValueError, match=r"unknown config key\(s\) \['data.shuffle'\]; did you mean 'data.shuffle_seed'"
    ):
        D.make_train_iterator({"shuffle": True}, seq_len=8, global_batch=2)


def test_text_files_by_glob_through_the_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(data_documents, "CHUNK_BYTES", 7)  # files are copied in 7-byte pieces: exercise the seams
    (tmp_path / "sub").mkdir()
    docs = {"a.txt": b"alpha " * 200, "sub/b.txt": b"beta " * 300, "c.md": b"not matched"}
    for name, text in docs.items():
        (tmp_path / name).write_bytes(text)
    cache = str(tmp_path / "cache")
    cfg = {"source": "text", "paths": str(tmp_path / "**" / "*.txt"), "validation_fraction": 0.2, "cache_dir": cache}
    loaded = D.load_documents("text", cfg["paths"])
    assert [d for _, d in loaded] == [docs["a.txt"], docs["sub/b.txt"]]
    s = D.load_corpus("text", cfg["paths"], 0.2, cache).streams
    assert isinstance(s["train"], np.memmap)
    assert s["train"].tobytes() == docs["a.txt"][:960] + b"\0" + docs["sub/b.txt"][:1200] + b"\0"
    assert s["validation"].tobytes() == docs["a.txt"][960:] + b"\0" + docs["sub/b.txt"][1200:] + b"\0"
    batch = next(D.make_train_iterator(cfg, seq_len=16, global_batch=2))
    assert set(np.unique(batch["inputs"])) <= set(b"alphbet \0")
    # unigram from the cached counts equals the direct computation
    train, val = s["train"], s["validation"]
    p = (np.bincount(train, minlength=256) + 1.0) / (train.size + 256)
    assert D.unigram_loss(cfg) == pytest.approx(-np.mean(np.log(p[val[1:]])), rel=1e-12)
    # grain pickles the window source into workers: a memory-mapped stream travels as its file name
    assert len(pickle.dumps(D.Windows(train, 16))) < 500
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(D.Windows(train, 16)))[5], D.Windows(train, 16)[5])
    # editing a file builds a new cache entry, with the new text
    (tmp_path / "a.txt").write_bytes(b"gamma " * 200)
    s2 = D.load_corpus("text", cfg["paths"], 0.2, cache).streams
    assert s2["train"].tobytes().startswith(b"gamma")
    assert len([d for d in os.listdir(cache) if ".tmp-" not in d]) == 2


def test_arrayrecord_records_are_documents(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    records = [b"first record text", b"second one", b"third " * 50]
    path = tmp_path / "part-0.array_record"
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for r in records:
        writer.write(r)
    writer.close()
    loaded = D.load_documents("arrayrecord", str(tmp_path / "*.array_record"))
    assert [d for _, d in loaded] == records
    (tmp_path / "bad.array_record").write_bytes(b"not an array record file")
    with pytest.raises(ValueError, match="cannot read .*bad.array_record"):
        D.load_documents("arrayrecord", str(tmp_path / "bad.array_record"))
