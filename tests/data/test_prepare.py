"""python -m lpt.data.prepare and the "prepared" source: the same windows as the on-the-fly path, random access,
resuming after an interruption, parallel workers, and the refusals (wrong tokenizer, other inputs, unfinished)."""

import json
import os
import pickle
import re

import numpy as np
import pytest
from cli_errors import one_error

import lpt.data as D
from lpt.data import prepare, prepare_out, prepared


def _write_docs(directory, n=24):
    """n text files from the embedded corpus (~150 kB), with some non-ASCII text."""
    os.makedirs(directory, exist_ok=True)
    for i, (_, doc) in enumerate(D.load_documents("embedded")[:n]):
        (directory / f"{i:02d}.txt").write_bytes(doc + f"\nÜbung {i}: 世界\n".encode())
    return str(directory / "*.txt")


def _run(tok, glob, out, **kw):
    kw = {"shard_mb": 0.01, "record_tokens": 97, "progress": False, **kw}  # 6 shards of 24 docs; windows cross records
    return prepare.prepare(tok, glob, str(out), **kw)


def _files(out):
    return {f: (out / f).read_bytes() for f in sorted(os.listdir(out))}


def test_prepared_windows_equal_on_the_fly_windows(bpe512, tmp_path):
    glob = _write_docs(tmp_path / "in")
    m = _run(bpe512, glob, tmp_path / "prep")
    assert m["complete"] and len(m["shards"]) >= 5 and m["tokenized"] == list(range(len(m["shards"])))
    fly = {"source": "text", "paths": glob, "tokenizer": bpe512, "cache_dir": str(tmp_path / "cache")}
    pre = {"source": "prepared", "paths": str(tmp_path / "prep"), "tokenizer": bpe512}
    a = D.load_corpus("text", glob, 0.1, fly["cache_dir"], bpe512)
    b = D.load_corpus("prepared", pre["paths"], 0.1, None, bpe512)
    for split in ("train", "validation"):
        s = b.streams[split]
        assert isinstance(s, D.PreparedStream) and s.size == a.streams[split].size == m["tokens"][split]
        np.testing.assert_array_equal(s[0 : s.size], a.streams[split])
        np.testing.assert_array_equal(b.counts[split], a.counts[split])
        assert b.text_bytes[split] == a.text_bytes[split] == m["bytes"][split]
        assert s[-1] == 0 and s[5] == a.streams[split][5]
    assert (a.streams["train"] >= 256).any()
    # the trainer's batches, shuffled and in order, and the baselines are the same
    it_a = D.make_train_iterator(fly, seq_len=64, global_batch=8, seed=1)
    it_b = D.make_train_iterator(pre, seq_len=64, global_batch=8, seed=1)
    for _ in range(4):
        x, y = next(it_a), next(it_b)
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
        np.testing.assert_array_equal(x["targets"], y["targets"])
    for x, y in zip(
        D.make_eval_batches(fly, seq_len=64, batch=8, num_batches=3),
        D.make_eval_batches(pre, seq_len=64, batch=8, num_batches=3),
        strict=True,
    ):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    assert D.unigram_loss(pre) == D.unigram_loss(fly) and D.bytes_per_token(pre) == D.bytes_per_token(fly)
    # random access: a window reads at most 2 records (97 ids each); a pickled window source is a few hundred bytes
    s = b.streams["train"]
    s._cache.clear()
    reads = []
    real = s._record
    s._record = lambda r: reads.append(r) or real(r)
    D.Windows(s, 64)[500]
    assert 1 <= len(reads) <= 2
    w = D.Windows(b.streams["train"], 64)
    assert len(pickle.dumps(w)) < 500
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(w))[123], w[123])


def test_prepare_with_bytes_from_arrayrecord_equals_the_byte_path(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    docs = [d for _, d in D.load_documents("embedded")[:10]] + [b"\xff\xfe not UTF-8"]
    for k in range(2):
        w = ArrayRecordWriter(str(tmp_path / f"part-{k}.array_record"), "group_size:1")
        for d in docs[k::2]:
            w.write(d)
        w.close()
    glob = str(tmp_path / "*.array_record")
    m = _run("bytes", glob, tmp_path / "prep", source="arrayrecord", shard_mb=1e-6)
    assert m["dtype"] == "uint8" and len(m["shards"]) == 2
    fly = D.load_corpus("arrayrecord", glob, 0.1, str(tmp_path / "cache")).streams
    pre = D.load_corpus("prepared", str(tmp_path / "prep"), 0.1).streams
    for split in ("train", "validation"):
        assert pre[split][0 : pre[split].size].tobytes() == fly[split].tobytes()
    assert D.bytes_per_token({"source": "prepared", "paths": str(tmp_path / "prep")}) == 1.0


def test_resume_after_an_interruption_gives_identical_files(bpe512, tmp_path, monkeypatch):
    glob = _write_docs(tmp_path / "in")
    clean = _run(bpe512, glob, tmp_path / "clean")
    n = len(clean["shards"])
    calls = []
    real = prepare.tokenize_shard

    def interrupted(task):
        calls.append(task["index"])
        if len(calls) == 4:  # Ctrl-C while the 4th shard is half written
            monkeypatch.setattr(prepare._RecordWriter, "close", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
        return real(task)

    monkeypatch.setattr(prepare, "tokenize_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(bpe512, glob, tmp_path / "resumed")
    half = json.loads((tmp_path / "resumed" / prepared.MANIFEST).read_text())
    assert sorted(half["finished"]) == ["0", "1", "2"] and not half["complete"]
    with pytest.raises(ValueError, match=r"is unfinished \(3 of \d+ shards\); rerun python -m lpt.data.prepare"):
        D.load_corpus("prepared", str(tmp_path / "resumed"), 0.1, tokenizer=bpe512)
    assert any(".tmp-" in f for f in os.listdir(tmp_path / "resumed"))  # the half-written shard's files
    os.remove(tmp_path / "resumed" / prepared.shard_file("train", 1))  # a finished shard's file went missing
    monkeypatch.undo()
    calls.clear()
    resumed = _run(bpe512, glob, tmp_path / "resumed")
    assert resumed["tokenized"] == [1, *range(3, n)]  # only the unfinished shards
    assert _files(tmp_path / "resumed") == _files(tmp_path / "clean")  # byte-identical shards, counts and manifest
    assert _run(bpe512, glob, tmp_path / "resumed")["tokenized"] == []  # a finished directory: nothing to do


def test_parallel_workers_give_the_same_files(bpe512, tmp_path):
    glob = _write_docs(tmp_path / "in", n=12)
    one = _run(bpe512, glob, tmp_path / "one", workers=1)
    two = _run(bpe512, glob, tmp_path / "two", workers=2)
    assert len(two["shards"]) >= 3 and two["tokenized"] == one["tokenized"]
    assert _files(tmp_path / "two") == _files(tmp_path / "one")


def test_refusals(bpe512, tmp_path, capsys):
    glob = _write_docs(tmp_path / "in", n=4)
    out = tmp_path / "prep"
    _run(bpe512, glob, out)
    with pytest.raises(ValueError, match=r"was prepared with tokenizer .*bpe512.json.* not --tokenizer 'bytes'"):
        _run("bytes", glob, out)
    capsys.readouterr()
    assert prepare.main(["--tokenizer", "bytes", "--input", glob, "--out", str(out)]) == 2  # the CLI: one line
    assert re.match(r"error: --out .* was prepared with tokenizer", capsys.readouterr().err)
    with pytest.raises(ValueError, match="was prepared with other validation_fraction"):
        _run(bpe512, glob, out, validation_fraction=0.2)
    (tmp_path / "in" / "00.txt").write_text("edited")
    with pytest.raises(ValueError, match=r"was prepared with other inputs \(files, sizes or mtimes\)"):
        _run(bpe512, glob, out)
    pre = {"source": "prepared", "paths": str(out)}
    with pytest.raises(ValueError, match=r"data.tokenizer='bytes' \(bytes\) is not the tokenizer .* prepared with"):
        D.make_eval_batches(pre, seq_len=8, batch=1, num_batches=1)
    with pytest.raises(ValueError, match="validation_fraction=0.2, but .* was prepared with 0.1"):
        D.make_eval_batches({**pre, "tokenizer": bpe512, "validation_fraction": 0.2}, seq_len=8, batch=1, num_batches=1)
    with pytest.raises(ValueError, match="is not a prepared directory .*python -m lpt.data.prepare"):
        D.make_eval_batches({**pre, "paths": str(tmp_path)}, seq_len=8, batch=1, num_batches=1)
    with pytest.raises(ValueError, match="--source 'json' is not supported"):
        _run(bpe512, glob, tmp_path / "x", source="json")
    with pytest.raises(ValueError, match="matches no files"):
        _run(bpe512, str(tmp_path / "*.none"), tmp_path / "x")


def _tree(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_second_prepare_into_the_same_out_is_refused_at_once(tmp_path, capsys):
    glob = _write_docs(tmp_path / "in", n=4)
    out = tmp_path / "prep"
    args = ["--tokenizer", "bytes", "--input", glob, "--out", str(out), "--workers", "1", "--shard-mb", "0.01"]
    assert prepare.main(args) == 0
    before = _tree(out)
    assert prepare_out.LOCK not in before  # removed when the prepare ended
    capsys.readouterr()
    with prepare_out.OutLock(str(out)):  # another prepare holds the directory (its own open file: flock conflicts)
        assert prepare.main(args) == 2
        one_error(capsys.readouterr().err, str(out), "in use by another prepare", f"pid {os.getpid()}")
    assert _tree(out) == before  # byte-identical: the refused prepare wrote and deleted nothing
    (out / prepare_out.LOCK).write_text('{"host": "gone", "pid": 1, "started": "yesterday"}')  # a crashed holder's file
    assert prepare.main(args) == 0 and _tree(out) == before  # taken over, finished, removed


def test_out_over_the_input_is_refused_before_anything_is_written(tmp_path, capsys):
    glob = _write_docs(tmp_path / "in", n=2)
    _write_docs(tmp_path / "in" / "sub", n=1)
    os.symlink(tmp_path / "in", tmp_path / "link")
    cases = [
        (glob, tmp_path / "in", "is the directory of --input files"),
        (glob, tmp_path / "link", "is the directory of --input files"),  # the same directory through a symlink
        (glob, tmp_path, "contains the directory of --input files"),
        (str(tmp_path / "in" / "**"), tmp_path / "in" / "prep", "lies where --input"),  # would read its own output
        (str(tmp_path / "link" / "*" / "*"), tmp_path / "in" / "prep", "lies where --input"),  # in/sub/00.txt
    ]
    before = _tree(tmp_path)
    for pattern, out, why in cases:
        argv = ["--tokenizer", "bytes", "--input", pattern, "--out", str(out), "--workers", "1"]
        assert prepare.main(argv) == 2, out
        one_error(capsys.readouterr().err, f"--out {str(out)!r}", why)
        assert _tree(tmp_path) == before and not (tmp_path / "in" / "prep").exists()
    # inside the input's directory where the glob does not reach: allowed
    argv = ["--tokenizer", "bytes", "--input", glob, "--out", str(tmp_path / "in" / "prep"), "--workers", "1"]
    assert prepare.main(argv) == 0


def test_train_tokenizer_does_not_write_where_it_reads(tmp_path, capsys):
    from lpt.data import train_tokenizer

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("some words of text\n" * 50)
    (tmp_path / "in" / "notes.json").write_text("more words of text\n" * 50)
    before = _tree(tmp_path)
    for pattern, out, why in [
        ("*", "notes.json", "is one of the --input files"),
        ("*", "tok.json", "lies where --input"),
        ("**/*.json", "tok.json", "lies where --input"),
    ]:
        argv = ["--vocab-size", "300", "--input", str(tmp_path / "in" / pattern), "--out", str(tmp_path / "in" / out)]
        assert train_tokenizer.main(argv) == 2
        one_error(capsys.readouterr().err, str(tmp_path / "in" / out), why)
        assert _tree(tmp_path) == before
    argv = ["--vocab-size", "300", "--input", str(tmp_path / "in" / "*.txt"), "--out", str(tmp_path / "in" / "t.json")]
    assert train_tokenizer.main(argv) == 0  # beside its input, where the glob does not reach
