"""Tokenizers in the data pipeline: BPE training, encoding of every source, the cache key, uint16 / uint32 streams,
bytes per token, unigram over any vocabulary, and the bytes path left exactly as it was."""

import json
import os

import numpy as np
import pytest

import lpt.data as D
from lpt.data import documents as data_documents
from lpt.data import train_tokenizer

TEXT = "Grüße, 世界! def f(x):\n    return x ** 2  # 🙂\n\n"


def _old_byte_streams(docs, f):
    """The byte streams as the bytes-only pipeline built them: each document's byte split, NUL after each part."""
    out = {"train": bytearray(), "validation": bytearray()}
    for _, doc in docs:
        cut = len(doc) - round(f * len(doc))
        for split, part in (("train", doc[:cut]), ("validation", doc[cut:])):
            if part:
                out[split] += part + b"\0"
    return {k: bytes(v) for k, v in out.items()}


def _char_split(doc: bytes, f: float) -> tuple[str, str]:
    cut = len(doc) - round(f * len(doc))
    while cut < len(doc) and doc[cut] & 0xC0 == 0x80:
        cut += 1
    return doc[:cut].decode(), doc[cut:].decode()


def test_train_tokenizer_bpe_round_trips_and_separates(bpe512, tmp_path):
    tok = D.load_tokenizer(bpe512)
    assert tok.vocab_size == 512 and tok.separator == 0 and tok.identity.startswith("sha256:")
    ids = tok.encode(TEXT)
    assert max(ids) >= 256 and len(ids) < len(TEXT.encode())  # merges are used
    assert tok.decode(ids) == TEXT  # byte-level: every text round-trips exactly
    assert tok.encode("a<|endoftext|>b")[1] == 0
    again = tmp_path / "new" / "again.json"  # deterministic: the same text gives the same file; dirs are made
    r = train_tokenizer.train_tokenizer(512, str(again), progress=False)
    assert again.read_bytes() == open(bpe512, "rb").read() and r["vocab_size"] == 512
    assert D.load_tokenizer(str(again)).identity == tok.identity
    with pytest.raises(ValueError, match="--vocab-size 100 must be an int >= 257"):
        train_tokenizer.train_tokenizer(100, str(tmp_path / "x.json"))
    with pytest.raises(ValueError, match="must end in .json"):
        train_tokenizer.train_tokenizer(300, str(tmp_path / "x.tok"))


def test_train_tokenizer_never_sees_the_validation_text(tmp_path):
    (tmp_path / "a.txt").write_text("common words " * 50 + "zqxv" * 40)  # 810 bytes; "zqxv" in the last 160
    out = tmp_path / "t.json"
    args = ["--vocab-size", "300", "--out", str(out), "--input", str(tmp_path / "*.txt")]
    train_tokenizer.main([*args, "--validation-fraction", "0.1"])  # the last 81 bytes are held out
    assert any("zq" in t for t in json.loads(out.read_text())["model"]["vocab"])
    train_tokenizer.main([*args, "--validation-fraction", "0.25"])  # the last 202 bytes are held out
    vocab = json.loads(out.read_text())["model"]["vocab"]
    assert any("common" in t for t in vocab) and not any("zq" in t or "xv" in t for t in vocab)


def test_embedded_corpus_with_bpe(bpe512):
    tok = D.load_tokenizer(bpe512)
    cfg = {"source": "embedded", "tokenizer": bpe512}
    streams = D.load_corpus("embedded", None, 0.1, tokenizer=bpe512).streams
    docs = D.load_documents("embedded")
    for i, split in enumerate(("train", "validation")):
        s = streams[split]
        assert s.dtype == np.uint16 and (s >= 256).mean() > 0.3
        parts = [_char_split(d, 0.1)[i] for _, d in docs]
        parts = [p for p in parts if p]
        assert int((s == 0).sum()) == len(parts)
        assert tok.decode(s) == "".join(p + "<|endoftext|>" for p in parts)  # documents, separator after each
        n_bytes = sum(len(p.encode()) + 1 for p in parts)
        assert D.bytes_per_token(cfg, split) == n_bytes / s.size
    assert 1.8 < D.bytes_per_token(cfg) < 2.2  # vocab 512 on English: ~2 bytes per token
    assert D.bytes_per_token({"source": "embedded"}) == 1.0
    # unigram over the 512 ids, from counts, equals the direct computation
    train, val = streams["train"], streams["validation"]
    p = (np.bincount(train, minlength=512) + 1.0) / (train.size + 512)
    assert D.unigram_loss(cfg) == pytest.approx(-np.mean(np.log(p[val[1:]])), rel=1e-12)
    # per token the BPE unigram is higher than the byte unigram, per byte lower (merges capture local structure)
    byte_unigram = D.unigram_loss({"source": "embedded"})
    assert D.unigram_loss(cfg) > byte_unigram > D.unigram_loss(cfg) / D.bytes_per_token(cfg)
    batch = D.make_eval_batches(cfg, seq_len=32, batch=4, num_batches=1)[0]
    np.testing.assert_array_equal(batch["inputs"][0], val[:32].astype(np.int32))
    assert batch["inputs"].max() >= 256


def test_bytes_path_is_unchanged(tmp_path):
    docs = D.load_documents("embedded")
    old = _old_byte_streams(docs, 0.1)
    new = D.load_corpus("embedded", None, 0.1).streams
    assert {k: v.tobytes() for k, v in new.items()} == old and new["train"].dtype == np.uint8
    for i, (_, d) in enumerate(docs[:12]):
        (tmp_path / f"{i:02d}.txt").write_bytes(d + "é\n".encode())
    glob = str(tmp_path / "*.txt")
    s = D.load_corpus("text", glob, 0.1, str(tmp_path / "cache")).streams
    assert {k: v.tobytes() for k, v in s.items()} == _old_byte_streams(D.load_documents("text", glob), 0.1)
    meta = json.loads(next((tmp_path / "cache").glob("*/meta.json")).read_text())
    # the bytes cache keeps its format and its key, with the full digest and the inputs added
    assert set(meta) == {"version", "tokens", "counts", "digest", "full_digest", "inputs"}
    cfg = {"source": "text", "paths": glob, "cache_dir": str(tmp_path / "cache")}
    assert D.bytes_per_token(cfg) == 1.0 and D.bytes_per_token(cfg, "train") == 1.0


def test_file_sources_with_a_tokenizer_and_the_cache_key(bpe512, tmp_path, monkeypatch):
    from array_record.python.array_record_module import ArrayRecordWriter

    tok = D.load_tokenizer(bpe512)
    docs = [TEXT * 3, "plain ascii text\n" * 5, "ü" * 7]
    w = ArrayRecordWriter(str(tmp_path / "d.array_record"), "group_size:1")
    for d in docs:
        w.write(d.encode())
    w.close()
    cache = str(tmp_path / "cache")
    s = D.load_corpus("arrayrecord", str(tmp_path / "*.array_record"), 0.2, cache, tokenizer=bpe512).streams
    expected = [_char_split(d.encode(), 0.2) for d in docs]
    for i, split in enumerate(("train", "validation")):
        want = np.concatenate([tok.encode(p[i]) + [0] for p in expected]).astype(np.uint16)
        assert isinstance(s[split], np.memmap) and s[split].dtype == np.uint16
        np.testing.assert_array_equal(s[split], want)
    # a different tokenizer at the same path never reuses the cached ids
    other = tmp_path / "tok.json"
    other.write_bytes(open(bpe512, "rb").read())
    s1 = D.load_corpus("arrayrecord", str(tmp_path / "*.array_record"), 0.2, cache, tokenizer=str(other)).streams
    np.testing.assert_array_equal(s1["train"], s["train"])  # same content: the same cache
    assert len([d for d in os.listdir(cache) if ".tmp-" not in d]) == 1
    train_tokenizer.train_tokenizer(300, str(other), progress=False)
    s2 = D.load_corpus("arrayrecord", str(tmp_path / "*.array_record"), 0.2, cache, tokenizer=str(other)).streams
    assert len([d for d in os.listdir(cache) if ".tmp-" not in d]) == 2
    assert s2["train"].max() < 300 < s["train"].max()
    assert D.load_tokenizer(str(other)).decode(s2["train"]) == "".join(p[0] + "<|endoftext|>" for p in expected)


def test_long_documents_are_encoded_in_line_pieces(bpe512, tmp_path, monkeypatch):
    monkeypatch.setattr(data_documents, "CHUNK_BYTES", 7)  # files are read in 7-byte chunks
    monkeypatch.setattr(data_documents, "PIECE_BYTES", 40)  # and tokenized in pieces of <= 40 bytes
    text = ("Grüße aus 世界, line %d\n" * 30 % tuple(range(30))) + "ä" * 60  # the tail has no line break
    raw = text.encode()
    pieces = list(data_documents._line_pieces([raw], 40))
    assert b"".join(pieces) == raw and max(map(len, pieces)) <= 40
    assert all(p.endswith(b"\n") for p in pieces[:-3]) and all(p.decode() for p in pieces)
    assert list(data_documents._line_pieces([raw[i : i + 5] for i in range(0, len(raw), 5)], 40)) == pieces
    (tmp_path / "big.txt").write_bytes(raw)
    tok = D.load_tokenizer(bpe512)
    s = D.load_corpus("text", str(tmp_path / "*.txt"), 0.1, str(tmp_path / "cache"), tokenizer=bpe512).streams
    train, val = _char_split(raw, 0.1)
    assert tok.decode(s["train"]) == train + "<|endoftext|>" and tok.decode(s["validation"]) == val + "<|endoftext|>"
    pieces = list(data_documents._line_pieces([train.encode()], 40))
    assert len(pieces) > 10 and s["train"].size == sum(len(tok.encode(p.decode())) for p in pieces) + 1


def test_vocab_over_65536_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for _, d in D.load_documents("embedded")[:3] for w in d.decode().split()})
    vocab = {"<|endoftext|>": 0, "[UNK]": 1} | {f"filler{i}": i + 2 for i in range(70_000)}
    vocab |= {w: 70_002 + i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "words.json"
    tok.save(str(path))
    assert D.token_dtype(65_536) == np.uint16 and D.token_dtype(65_537) == np.uint32
    s = D.load_corpus("embedded", None, 0.1, tokenizer=str(path)).streams
    assert s["train"].dtype == np.uint32 and s["train"].max() >= 70_002
    assert D.load_tokenizer(str(path)).vocab_size == len(vocab)
    batch = D.make_eval_batches({"source": "embedded", "tokenizer": str(path)}, seq_len=16, batch=2, num_batches=1)
    assert batch[0]["inputs"].dtype == np.int32 and batch[0]["inputs"].max() >= 70_002


def test_sentencepiece_model(tmp_path):
    import sentencepiece as spm

    texts = [_char_split(d, 0.1)[0] for _, d in D.load_documents("embedded")[:20]]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(t for x in texts for t in x.splitlines() if t.strip()),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=400,
        minloglevel=2,
    )
    sp = D.load_tokenizer(str(tmp_path / "sp.model"))
    assert sp.vocab_size == 400 and sp.separator == 2  # eos </s>
    s = D.load_corpus("embedded", None, 0.1, tokenizer=str(tmp_path / "sp.model")).streams
    n_parts = sum(bool(_char_split(d, 0.1)[1]) for _, d in D.load_documents("embedded"))
    assert s["validation"].dtype == np.uint16 and int((s["validation"] == 2).sum()) == n_parts
    assert s["train"].max() >= 256


def test_tokenizer_errors(bpe512, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 20)
    with pytest.raises(ValueError, match=r"latin1.txt' is not UTF-8 text .*only data.tokenizer='bytes'"):
        D.load_corpus("text", str(tmp_path / "*.txt"), 0.1, str(tmp_path / "c"), tokenizer=bpe512)
    D.load_corpus("text", str(tmp_path / "*.txt"), 0.1, str(tmp_path / "c"))  # bytes takes any bytes
    with pytest.raises(ValueError, match="not 'bytes' and not an existing file"):
        D.make_eval_batches({"tokenizer": str(tmp_path / "nope.json")}, seq_len=8, batch=1, num_batches=1)
    with pytest.raises(ValueError, match="config.data.tokenizer='' must be"):
        D.make_eval_batches({"tokenizer": ""}, seq_len=8, batch=1, num_batches=1)


def test_model_vocab_size_comes_from_the_tokenizer(bpe512):
    from lpt.train import config as config_lib

    base = config_lib.load_config_file("tiny_cpu")
    cfg = config_lib.apply_overrides(base, {"data.tokenizer": bpe512})
    assert base.model.vocab_size == 0 and cfg.model.vocab_size == 512
    assert config_lib.resolve(base).model.vocab_size == 256
    assert config_lib.apply_overrides(base, {"data.source": "prepared"}).data.source == "prepared"
