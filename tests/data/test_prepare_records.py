"""Record inputs (JSON Lines, gzip / zstd compressed, Parquet): one document per record, the text field alone is
tokenized, bad records are reported by file and line and left out, ``--validation-split docs`` holds out whole
documents, and an interrupted run resumes to identical files. The trainer's ``source="jsonl"`` / ``"parquet"`` reads
the same documents."""

import gzip
import json
import os
import re

import numpy as np
import pytest

import lpt.data as D
from lpt.data import documents, prepare, prepared

N = 120


def _texts(n=N):
    """n distinct paragraphs of the embedded corpus, with what JSON escapes (quotes, backslashes, newlines, tabs)
    and non-ASCII text."""
    paras = [p for _, d in D.load_documents("embedded") for p in d.decode().split("\n\n") if len(p.strip()) > 40]
    texts = list(dict.fromkeys(paras))[:n]
    assert len(texts) == n
    return [t + f'\n"quoted" \\ back\tslash, Übung {i}: 世界' for i, t in enumerate(texts)]


def _write(path, texts, field="text"):
    """``texts`` as records of ``field`` in a JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet file."""
    path = str(path)
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"id": list(range(len(texts))), field: texts})
        pq.write_table(table, path, row_group_size=50)  # several row groups
        return path
    data = "".join(json.dumps({"id": i, field: t, "meta": {"n": [1, 2]}}) + "\n" for i, t in enumerate(texts)).encode()
    if path.endswith(".gz"):
        data = gzip.compress(data)
    elif path.endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    with open(path, "wb") as fh:
        fh.write(data)
    return path


def _run(tok, glob, out, **kw):
    return prepare.prepare(tok, glob, str(out), **{"progress": False, "shard_mb": 0.01, "record_tokens": 97, **kw})


def _streams(out, tok):
    s = D.load_corpus("prepared", str(out), 0.1, tokenizer=tok).streams
    return {k: v[0 : v.size] for k, v in s.items()}


def _expected(tok, texts, split="docs", fraction=0.1):
    """The train / validation streams of ``texts`` tokenized directly, one document each."""
    out = {"train": [], "validation": []}
    for t in texts:
        held = documents.holds_out(t.encode(), fraction) if split == "docs" else None
        for s in ("train", "validation"):
            if (s == "validation") == held:
                out[s] += [*tok.encode(t), tok.separator]
    return {s: np.array(v, np.int64) for s, v in out.items()}


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz", "d.jsonl.zst", "d.parquet"])
def test_each_record_is_one_document_of_its_text_alone(bpe512, tmp_path, name):
    texts = _texts()
    glob = _write(tmp_path / name, texts)
    tok = D.load_tokenizer(bpe512)
    m = _run(bpe512, glob, tmp_path / "prep")
    assert m["source"] == ("parquet" if name.endswith(".parquet") else "jsonl")  # from the file name
    assert m["documents"] == N and m["bad_records"] == 0 and m["validation_split"] == "docs"
    own = sum(len(tok.encode(t)) + 1 for t in texts)  # the texts' own tokens and one separator each
    assert sum(m["tokens"].values()) == own
    held = {t for t in texts if documents.holds_out(t.encode(), 0.1)}
    assert m["bytes"]["validation"] == sum(len(t.encode()) + 1 for t in held)  # UTF-8 text + 1 per separator
    assert m["bytes"]["train"] == sum(len(t.encode()) + 1 for t in texts if t not in held)
    got, want = _streams(tmp_path / "prep", bpe512), _expected(tok, texts)
    for s in ("train", "validation"):
        np.testing.assert_array_equal(got[s], want[s])
    # the trainer's on-the-fly path reads the same documents through the same registry
    fly = D.load_corpus(m["source"], glob, 0.1, str(tmp_path / "cache"), bpe512).streams
    for s in ("train", "validation"):
        np.testing.assert_array_equal(fly[s], want[s])


def test_bytes_tokenizer_and_the_config_source(tmp_path):
    texts = _texts(40)
    glob = _write(tmp_path / "d.jsonl", texts)
    cfg = {"source": "jsonl", "paths": glob, "cache_dir": str(tmp_path / "cache"), "validation_fraction": 0.2}
    s = D.load_corpus("jsonl", glob, 0.2, cfg["cache_dir"]).streams
    for split in ("train", "validation"):
        held = [t for t in texts if (split == "validation") == documents.holds_out(t.encode(), 0.2)]
        assert s[split].tobytes() == b"".join(t.encode() + b"\0" for t in held)
    batch = D.make_eval_batches(cfg, seq_len=16, batch=2, num_batches=1)[0]
    assert batch["inputs"].shape == (2, 16)
    m = _run("bytes", glob, tmp_path / "prep", validation_fraction=0.2)
    held = sum(documents.holds_out(t.encode(), 0.2) for t in texts)
    assert m["split_documents"] == {"train": 40 - held, "validation": held} and 0 < held < 40
    pre = D.load_corpus("prepared", str(tmp_path / "prep"), 0.2).streams
    assert {k: v[0 : v.size].tobytes() for k, v in pre.items()} == {k: v.tobytes() for k, v in s.items()}


def test_bad_records_are_reported_with_file_and_line_and_left_out(bpe512, tmp_path, capsys):
    good = _texts(6)
    lines = [
        json.dumps({"text": good[0]}).encode(),
        b'{"text": "unterminated',  # 2: not JSON
        json.dumps({"body": "no text field"}).encode(),  # 3
        json.dumps({"text": good[1]}).encode(),
        b"   ",  # 5: blank, not a record
        json.dumps({"text": 42}).encode(),  # 6: not a string
        b'{"text": "caf\xe9"}',  # 7: Latin-1, not UTF-8
        json.dumps(["text", "an array"]).encode(),  # 8
        b'{"text": "half a pair \\ud800"}',  # 9: an unpaired surrogate escape
        *(json.dumps({"text": t}).encode() for t in good[2:]),
    ]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "prep"
    capsys.readouterr()
    assert prepare.main(["--tokenizer", bpe512, "--input", str(path), "--out", str(out), "--workers", "1"]) == 0
    err = capsys.readouterr()
    reported = re.findall(r"skipped bad record (.*?):(\d+): (.*)", err.err)
    assert [(f, int(n)) for f, n, _ in reported] == [(str(path), n) for n in (2, 3, 6, 7, 8, 9)]
    reasons = [r for _, _, r in reported]
    assert reasons[0].startswith("not valid JSON") and reasons[1] == "no field 'text'"
    assert reasons[2] == "field 'text' is a number, not a string" and reasons[3].startswith("not UTF-8")
    assert reasons[4] == "not a JSON object but an array" and "unpaired surrogate" in reasons[5]
    m = json.loads((out / prepared.MANIFEST).read_text())
    assert m["bad_records"] == 6 and m["documents"] == 6
    assert m["finished"]["0"]["bad_examples"][0].startswith(f"{path}:2: not valid JSON")
    assert "6 documents" in err.out and "6 bad records skipped" in err.out
    tok = D.load_tokenizer(bpe512)
    assert sum(m["tokens"].values()) == sum(len(tok.encode(t)) + 1 for t in good)  # the good records only
    # --max-bad-records: one line, naming the limit and the record that passed it
    args = ["--tokenizer", bpe512, "--input", str(path), "--workers", "1", "--max-bad-records", "2"]
    assert prepare.main([*args, "--out", str(tmp_path / "strict")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: 3 bad records, more than --max-bad-records=2 allows \(the last: {path}:6: .*", last)
    assert prepare.main([*args, "--out", str(tmp_path / "strict"), "--max-bad-records", "6"]) == 0  # resumes
    # the limit holds for all shards together, also on a rerun that has nothing left to tokenize
    for k in range(2):
        (tmp_path / "two").mkdir(exist_ok=True)
        (tmp_path / "two" / f"{k}.jsonl").write_bytes(b"\n".join(lines) + b"\n")  # 6 bad records each
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^12 bad records, more than --max-bad-records=10 allows .*the first: "):
            _run(bpe512, str(tmp_path / "two" / "*.jsonl"), tmp_path / "two-out", shard_mb=1e-6, max_bad_records=10)
    # another field, and a Parquet null
    path.write_text("".join(json.dumps({"body": t}) + "\n" for t in good))
    m = _run(bpe512, str(path), tmp_path / "body", text_field="body")
    assert m["documents"] == 6 and m["bad_records"] == 0 and m["text_field"] == "body"
    pq = _write(tmp_path / "n.parquet", [good[0], None, good[1]])
    m = _run(bpe512, pq, tmp_path / "pq")
    assert m["documents"] == 2 and m["finished"]["0"]["bad_examples"] == [f"{pq}:row 1: column 'text' is null"]


def test_docs_split_holds_out_whole_documents(bpe512, tmp_path):
    texts = _texts(400)
    glob = _write(tmp_path / "d.jsonl", texts)
    tok = D.load_tokenizer(bpe512)
    m = _run(bpe512, glob, tmp_path / "docs", validation_split="docs")
    s = _streams(tmp_path / "docs", bpe512)
    parts = {}
    for split in ("train", "validation"):  # the stream cut at separators: each piece must be one whole text
        ids = s[split]
        ends = np.flatnonzero(ids == tok.separator)
        parts[split] = [
            tok.decode(ids[a + 1 if a >= 0 else 0 : b]) for a, b in zip([-1, *ends[:-1]], ends, strict=True)
        ]
        assert ends[-1] == ids.size - 1
    assert sorted(parts["train"] + parts["validation"]) == sorted(texts)  # every text whole, in one split only
    assert not set(parts["train"]) & set(parts["validation"])
    assert m["split_documents"] == {"train": len(parts["train"]), "validation": len(parts["validation"])}
    assert abs(len(parts["validation"]) / len(texts) - 0.1) < 0.04
    assert abs(m["tokens"]["validation"] / sum(m["tokens"].values()) - 0.1) < 0.04
    # tail: the end of every document
    t = _run(bpe512, glob, tmp_path / "tail", validation_split="tail")
    assert t["split_documents"] == {"train": 400, "validation": 400} and t["validation_split"] == "tail"
    with pytest.raises(ValueError, match=r"was prepared with other validation_split \('docs' vs 'tail'\)"):
        _run(bpe512, glob, tmp_path / "docs", validation_split="tail")
    with pytest.raises(ValueError, match=r"--validation-split 'random' is not supported; allowed: \['tail', 'docs'\]"):
        _run(bpe512, glob, tmp_path / "x", validation_split="random")


def test_jsonl_resume_after_an_interruption_gives_identical_files(bpe512, tmp_path, monkeypatch):
    texts = _texts(180)
    (tmp_path / "in").mkdir()
    for k in range(6):  # plain and gzip files, read as JSON Lines from their names
        _write(tmp_path / "in" / (f"part-{k}.jsonl.gz" if k % 2 else f"part-{k}.jsonl"), texts[k::6])
    with open(tmp_path / "in" / "part-2.jsonl", "ab") as fh:
        fh.write(b"not json\n")  # a bad record, reported in the manifest of its shard
    glob = str(tmp_path / "in" / "*")
    kw = {"shard_mb": 1e-6}  # one file per shard
    clean = _run(bpe512, glob, tmp_path / "clean", **kw)
    assert len(clean["shards"]) == 6 and clean["documents"] == 180 and clean["bad_records"] == 1
    calls = []
    real = prepare.tokenize_shard

    def interrupted(task):
        calls.append(task["index"])
        if len(calls) == 4:  # Ctrl-C while the 4th shard is half written
            monkeypatch.setattr(prepare._RecordWriter, "close", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
        return real(task)

    monkeypatch.setattr(prepare, "tokenize_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(bpe512, glob, tmp_path / "resumed", **kw)
    monkeypatch.undo()
    resumed = _run(bpe512, glob, tmp_path / "resumed", **kw)
    assert resumed["tokenized"] == [3, 4, 5]

    def files(out):
        return {f: (out / f).read_bytes() for f in sorted(os.listdir(out))}

    assert files(tmp_path / "resumed") == files(tmp_path / "clean")


def test_format_refusals(bpe512, tmp_path):
    _write(tmp_path / "a.jsonl", ["one"])
    (tmp_path / "b.txt").write_text("two")
    with pytest.raises(ValueError, match=r"--input .* matches files of several formats \(jsonl: .*a.jsonl', text: "):
        _run(bpe512, str(tmp_path / "*"), tmp_path / "x")
    m = _run("bytes", str(tmp_path / "*"), tmp_path / "t", source="text")  # named: every file is text
    assert m["documents"] == 2 and m["validation_split"] == "tail" and m["text_field"] is None
    with pytest.raises(ValueError, match=r"--text-field 'body' does not apply to --source text"):
        _run(bpe512, str(tmp_path / "b.txt"), tmp_path / "y", text_field="body")
    with pytest.raises(ValueError, match=r"--max-bad-records -1 must be an int >= 0"):
        _run(bpe512, str(tmp_path / "a.jsonl"), tmp_path / "y", max_bad_records=-1)
    pq = _write(tmp_path / "c.parquet", ["x"], field="body")
    with pytest.raises(ValueError, match=r"c.parquet' has no column 'text' to read the text from; columns: \['id', "):
        _run(bpe512, pq, tmp_path / "z")
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:30])
    with pytest.raises(ValueError, match=r"cannot read .*d.jsonl.gz' as gzip-compressed JSON Lines .* after line \d+"):
        _run(bpe512, str(tmp_path / "d.jsonl.gz"), tmp_path / "w")


@pytest.mark.parametrize("kind", ["plain", "corrupt"])
def test_a_gz_file_that_is_not_gzip_is_one_error(kind, tmp_path, capsys):
    """A ``.jsonl.gz`` that holds plain JSON Lines, or a gzip header followed by damaged data: one line naming the
    file and what it must be, from prepare (exit 2) and from the trainer's source="jsonl"."""
    path = tmp_path / "in" / "d.jsonl.gz"
    path.parent.mkdir()
    data = b'{"text": "one"}\n' * 100
    path.write_bytes(data if kind == "plain" else gzip.compress(data)[:10] + b"\xff" * 40)
    argv = ["--tokenizer", "bytes", "--input", str(path), "--out", str(tmp_path / "prep"), "--workers", "1"]
    assert prepare.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: cannot read {str(path)!r} as gzip-compressed JSON Lines (its name ends .gz)")
    with pytest.raises(ValueError, match=r"^cannot read .*d.jsonl.gz' as gzip-compressed JSON Lines"):
        D.load_corpus("jsonl", str(path), 0.1, str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache") == []  # the half-built cache was removed
