"""Tokenizers: text <-> token ids, by ``config.data.tokenizer``.

* ``"bytes"``: UTF-8 bytes are the tokens (vocab 256; id 0, NUL, separates documents). No file, no download.
* a path to a Hugging Face ``tokenizer.json``: the ``tokenizers`` package (BPE, WordPiece, Unigram, ...).
  ``python -m lpt.data.train_tokenizer`` makes a byte-level BPE one.
* a path to a SentencePiece ``.model``: the ``sentencepiece`` package.

Every tokenizer has ``vocab_size``, ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``separator``: the id
written after each document when documents are packed into one stream (bytes: 0; otherwise the tokenizer's
end-of-text token, found by name, else id 0), ``name`` (the spec it was loaded from) and ``identity``: ``"bytes"``
or ``"sha256:<first 16 hex digits of the file's content>"``. Data caches and prepared directories are keyed by the
identity, so editing or replacing a tokenizer file never reuses token ids made by the old one, while moving the
file does not invalidate them.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np

# special tokens that end a document, by the names common tokenizers give them
_END_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
_FROM_BUFFER = "Cannot instantiate Tokenizer from buffer: "  # how tokenizers' ValueError for a bad file begins


class ByteTokenizer:
    """UTF-8 bytes as tokens: ``encode`` is ``list(text.encode())``; ``decode`` replaces invalid UTF-8."""

    name = "bytes"
    identity = "bytes"
    vocab_size = 256
    separator = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _identity(data: bytes) -> str:
    """``"sha256:<first 16 hex digits>"`` of a tokenizer file's content."""
    return "sha256:" + hashlib.sha256(data).hexdigest()[:16]


def _not_a(path: Path, what: str, error: str) -> ValueError:
    """The ValueError for a tokenizer file that its library could not parse (``error``: the library's message)."""
    first = next((ln.strip() for ln in error.splitlines() if ln.strip()), "")
    return ValueError(
        f"data.tokenizer={str(path)!r} is not a valid {what} ({first}); give 'bytes', a Hugging Face "
        "tokenizer.json, or a SentencePiece .model"
    )


class _HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (the ``tokenizers`` package); no special tokens are added on ``encode``.
    ValueError naming the file when ``tokenizers`` cannot parse it."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        data = path.read_bytes()  # read here: an I/O error stays an OSError, a parse error is a ValueError
        self.name = str(path)
        self.identity = _identity(data)
        try:
            self._tok = Tokenizer.from_buffer(data)
        except ValueError as e:  # "Cannot instantiate Tokenizer from buffer: <serde's message>"
            raise _not_a(path, "Hugging Face tokenizer.json", str(e).removeprefix(_FROM_BUFFER)) from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = [self._tok.token_to_id(t) for t in _END_TOKENS]
        self.separator = next((i for i in ids if i is not None), 0)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class _SentencePieceTokenizer:
    """A SentencePiece ``.model``; the separator is its ``eos_id`` (else 0). ValueError naming the file when
    ``sentencepiece`` cannot parse it."""

    def __init__(self, path: Path):
        import sentencepiece

        data = path.read_bytes()
        self.name = str(path)
        self.identity = _identity(data)
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(data)
        except RuntimeError as e:  # "INTERNAL: ..." for bytes that are not a ModelProto (or one with no unk piece)
            detail = "not a serialized ModelProto" if "ParseFromArray" in str(e) else str(e)
            raise _not_a(path, "SentencePiece model", detail) from None
        self.vocab_size = self._sp.get_piece_size()
        self.separator = self._sp.eos_id() if self._sp.eos_id() >= 0 else 0

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


Tokenizer = ByteTokenizer | _HFTokenizer | _SentencePieceTokenizer


def token_dtype(vocab_size: int) -> np.dtype:
    """The unsigned dtype token streams of this vocabulary are stored in: uint8 up to 256 ids (the bytes
    tokenizer), uint16 up to 65,536, else uint32."""
    if vocab_size <= 256:
        return np.dtype(np.uint8)
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@functools.lru_cache(maxsize=8)
def _load_file(path: str, size: int, mtime_ns: int) -> Tokenizer:  # keyed by size and mtime: an edit reloads
    p = Path(path)
    return _HFTokenizer(p) if p.suffix == ".json" else _SentencePieceTokenizer(p)


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """The tokenizer named by ``config.data.tokenizer``: "bytes", a ``*.json`` file, or a ``*.model`` file (loaded
    once per process and file version). ValueError naming the spec for anything else: a missing file, another
    suffix, or a file its library cannot parse (a truncated tokenizer.json, a .model that is not SentencePiece's)."""
    if str(spec) == "bytes":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not str(spec) or not path.is_file():
        raise ValueError(
            f"data.tokenizer={str(spec)!r} is not 'bytes' and not an existing file; give 'bytes', a Hugging Face "
            "tokenizer.json, or a SentencePiece .model (python -m lpt.data.train_tokenizer makes one)"
        )
    if path.suffix not in (".json", ".model"):
        raise ValueError(
            f"data.tokenizer={str(spec)!r}: unknown tokenizer file type {path.suffix!r}; allowed: a Hugging Face "
            "tokenizer.json ('.json') or a SentencePiece model ('.model')"
        )
    st = path.stat()
    return _load_file(str(path.resolve()), st.st_size, st.st_mtime_ns)
