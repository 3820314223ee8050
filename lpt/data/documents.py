"""How one document divides into the train and the validation stream, and its token ids: the split rules that the
data cache (:mod:`lpt.data.cache`), ``python -m lpt.data.prepare`` and the tokenizer trainer share.

Validation split (``validation_split``, :data:`VALIDATION_SPLITS`): ``"tail"`` holds out the last
``validation_fraction`` of every document (:func:`split_document`); ``"docs"`` holds out whole documents, those whose
content hash is below the fraction (:func:`holds_out`), so about ``validation_fraction`` of the documents, and the
same text (a duplicate, or the same document from another file or format) always lands in the same split.

Encoding with a tokenizer other than "bytes" (:func:`encoded_parts`, shared with ``python -m lpt.data.prepare``):
each document is split where the bytes tokenizer splits it (``cut = len − round(f · len)``), moved forward past
UTF-8 continuation bytes so that no character is cut; each part is decoded as UTF-8 (a document that is not UTF-8
is an error) and encoded, and the separator id follows each non-empty part. A part longer than ``PIECE_BYTES``
(1 MiB) is encoded in pieces of at most that size, each ending after the last line break that fits (else at a
character boundary), so a huge file never sits in the tokenizer at once; the pieces are a function of the text
alone. Text bytes of a split = UTF-8 bytes of its text + 1 per separator (the bytes tokenizer's NUL), so for
"bytes" they equal the token count.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator

import numpy as np

SPLITS = ("train", "validation")
VALIDATION_SPLITS = ("tail", "docs")


def split_document(doc: bytes, validation_fraction: float) -> tuple[bytes, bytes]:
    """(train part, validation part): the last ``round(f · len)`` bytes go to validation."""
    cut = len(doc) - round(validation_fraction * len(doc))
    return doc[:cut], doc[cut:]


CHUNK_BYTES = 1 << 26  # 64 MiB: files are read in pieces of this size
PIECE_BYTES = 1 << 20  # 1 MiB: the longest text handed to a tokenizer at once


def _read_range(path: str, start: int, stop: int) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        fh.seek(start)
        pos = start
        while pos < stop:
            piece = fh.read(min(CHUNK_BYTES, stop - pos))
            if not piece:
                raise ValueError(f"{path!r} shrank while it was being read into the data cache")
            pos += len(piece)
            yield piece


def holds_out(doc: bytes | str, validation_fraction: float) -> bool:
    """Whether the ``"docs"`` split holds out the whole document (bytes or a file path, read in pieces): the first 8
    bytes of the blake2b hash of its content, as a big-endian number, are below ``validation_fraction · 2⁶⁴``."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(doc, bytes | bytearray):
        h.update(doc)
    else:
        for piece in _read_range(doc, 0, os.path.getsize(doc)):
            h.update(piece)
    return int.from_bytes(h.digest(), "big") < validation_fraction * 2.0**64  # int < float compares exactly


def document_fraction(doc: bytes | str, validation_fraction: float, validation_split: str) -> float:
    """The share of ``doc`` that goes to validation: ``validation_fraction`` for ``"tail"``; 1.0 or 0.0 for
    ``"docs"`` (:func:`holds_out`). The parts are then cut with it exactly as for ``"tail"``."""
    if validation_split == "tail":
        return validation_fraction
    if validation_split == "docs":
        return 1.0 if holds_out(doc, validation_fraction) else 0.0
    raise ValueError(f"validation_split={validation_split!r} is not supported; allowed: {list(VALIDATION_SPLITS)}")


def document_parts(doc: bytes | str, validation_fraction: float) -> tuple[Iterable[bytes], Iterable[bytes]]:
    """(train pieces, validation pieces) of one document, given as bytes or as a file path (read in pieces, so a
    single huge file never sits in memory). Same cut as :func:`split_document`."""
    if isinstance(doc, bytes | bytearray):
        train, val = split_document(bytes(doc), validation_fraction)
        return [train], [val]
    size = os.path.getsize(doc)
    cut = size - round(validation_fraction * size)
    return _read_range(doc, 0, cut), _read_range(doc, cut, size)


def _is_continuation(byte: int) -> bool:
    return byte & 0xC0 == 0x80  # 10xxxxxx: inside a multi-byte UTF-8 character


def _char_cut(size: int, validation_fraction: float, head: bytes) -> int:
    """:func:`split_document`'s cut moved forward past UTF-8 continuation bytes; ``head`` = the (up to 3) bytes
    that follow the unmoved cut."""
    cut = size - round(validation_fraction * size)
    k = 0
    while k < len(head) and _is_continuation(head[k]):
        k += 1
    return cut + k


def _line_pieces(chunks: Iterable[bytes], limit: int) -> Iterator[bytes]:
    """Re-cut a byte sequence (given in arbitrary chunks) greedily into pieces of at most ``limit`` bytes, each
    ending after the last ``\\n`` that fits, else at a UTF-8 character boundary. The pieces depend on the bytes
    only, not on how they were chunked."""
    rest = b""
    for chunk in chunks:
        data = rest + chunk if rest else bytes(chunk)
        pos = 0
        while len(data) - pos > limit:
            end = data.rfind(b"\n", pos, pos + limit) + 1
            if end <= pos:  # no line break in reach: cut before a character's first byte
                end = pos + limit
                while end > pos + 1 and _is_continuation(data[end]):
                    end -= 1
            yield data[pos:end]
            pos = end
        rest = data[pos:]
    if rest:
        yield rest


def text_parts(doc: bytes | str, validation_fraction: float) -> tuple[Iterator[bytes], Iterator[bytes]]:
    """(train pieces, validation pieces) of one document (bytes or a file path) for a tokenizer: cut at a character
    boundary, each part in pieces of at most ``PIECE_BYTES`` ending at line breaks (see the module docstring)."""
    if isinstance(doc, bytes | bytearray):
        doc, size = bytes(doc), len(doc)
        start = size - round(validation_fraction * size)
        cut = _char_cut(size, validation_fraction, doc[start : start + 3])
        return _line_pieces([doc[:cut]], PIECE_BYTES), _line_pieces([doc[cut:]], PIECE_BYTES)
    size = os.path.getsize(doc)
    with open(doc, "rb") as fh:
        fh.seek(size - round(validation_fraction * size))
        cut = _char_cut(size, validation_fraction, fh.read(3))
    return _line_pieces(_read_range(doc, 0, cut), PIECE_BYTES), _line_pieces(_read_range(doc, cut, size), PIECE_BYTES)


def encoded_parts(
    tokenizer, doc: bytes | str, validation_fraction: float, name: str, validation_split: str = "tail"
) -> Iterator[tuple[str, list | np.ndarray, int]]:
    """``(split, token ids, text bytes)`` of one document in stream order: the train part's pieces, its separator
    (``[separator]``, 1 byte) if the part is not empty, then the same for the validation part (with ``"docs"`` one of
    the parts is the whole document, :func:`document_fraction`). ``name`` names the document in errors. With the
    bytes tokenizer the pieces are :func:`document_parts` (any bytes; the uint8 ids are the bytes), so the stream is
    the one :func:`lpt.data.cache.build_or_open` writes.

    Args:
      tokenizer: a tokenizer of :mod:`lpt.data.tokenizer` (``identity``, ``separator``, ``encode``).
      doc: the document as bytes, or the path of a file holding it (read in pieces).
      validation_fraction: share held out for validation (of each document for ``"tail"``, of the documents for
        ``"docs"``).
      name: the document's name in errors.
      validation_split: ``"tail"`` or ``"docs"`` (:data:`VALIDATION_SPLITS`).
    """
    validation_fraction = document_fraction(doc, validation_fraction, validation_split)
    if tokenizer.identity == "bytes":
        for split, pieces in zip(SPLITS, document_parts(doc, validation_fraction), strict=True):
            n = 0
            for piece in pieces:
                n += len(piece)
                yield split, np.frombuffer(piece, np.uint8), len(piece)
            if n:
                yield split, [tokenizer.separator], 1
        return
    for split, pieces in zip(SPLITS, text_parts(doc, validation_fraction), strict=True):
        n = 0
        for piece in pieces:
            try:
                text = piece.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"document {name!r} is not UTF-8 text ({e.reason} at byte {n + e.start} of its {split} part); "
                    f"data.tokenizer={tokenizer.name!r} needs UTF-8, only data.tokenizer='bytes' takes any bytes"
                ) from None
            n += len(piece)
            yield split, tokenizer.encode(text), len(piece)
        if n:
            yield split, [tokenizer.separator], 1
