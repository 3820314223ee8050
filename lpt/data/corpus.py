"""Documents -> byte tokens -> train / validation token streams.

Sources (``config.data.source``):

* ``"embedded"``: the English help texts CPython ships as ``pydoc_data.topics`` (79 documents, no download), in
  sorted topic order, with repeated paragraphs removed (:func:`dedupe_paragraphs`: 466 kB -> 374 kB). The topics
  overlap heavily ("specialnames" contains "customization", "compound" contains "if", ...): without the dedupe
  28% of the validation split's 64-byte chunks occur verbatim in the train split, with it 0.3%.
* ``"text"``: every file matching the glob ``config.data.paths`` (``**`` recursive), sorted by path; one file is
  one document (its raw bytes).
* ``"arrayrecord"``: every record of every ArrayRecord file matching ``config.data.paths`` (sorted); one record is
  one document (raw bytes, e.g. UTF-8 text).

Tokens are bytes (vocab 256). Documents are joined with the separator token 0 (NUL, absent from text) after each
document: ``doc₀ 0 doc₁ 0 …``.

Split: the last ``validation_fraction`` of each document's bytes (``cut = len − round(f · len)``) goes to the
validation stream, the rest to the train stream. Deterministic, disjoint, exact in proportion, and it works for
a single large file as well as for many small ones.
"""

from __future__ import annotations

import functools
import glob as globlib
import os

import numpy as np

SOURCES = ("embedded", "text", "arrayrecord")
SEPARATOR = 0
VOCAB_SIZE = 256


def dedupe_paragraphs(docs: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """Drop every paragraph (blank-line separated) whose stripped text already appeared earlier in ``docs``."""
    seen: set[bytes] = set()
    out = []
    for name, doc in docs:
        keep = []
        for para in doc.split(b"\n\n"):
            key = para.strip()
            if key and key in seen:
                continue
            seen.add(key)
            keep.append(para)
        out.append((name, b"\n\n".join(keep)))
    return out


def _embedded_documents() -> list[tuple[str, bytes]]:
    from pydoc_data import topics

    docs = [(name, topics.topics[name].encode("utf-8")) for name in sorted(topics.topics)]
    return dedupe_paragraphs(docs)


def _glob(paths: str | None, source: str) -> list[str]:
    if not paths or not isinstance(paths, str):
        raise ValueError(f"config.data.paths={paths!r}: source={source!r} needs a glob string of input files")
    files = sorted(f for f in globlib.glob(os.path.expanduser(paths), recursive=True) if os.path.isfile(f))
    if not files:
        raise ValueError(f"config.data.paths={paths!r} matches no files (source={source!r})")
    return files


def _text_documents(paths: str) -> list[tuple[str, bytes]]:
    docs = []
    for f in _glob(paths, "text"):
        with open(f, "rb") as fh:
            docs.append((f, fh.read()))
    return docs


def _arrayrecord_documents(paths: str) -> list[tuple[str, bytes]]:
    from array_record.python.array_record_module import ArrayRecordReader

    docs = []
    for f in _glob(paths, "arrayrecord"):
        try:
            reader = ArrayRecordReader(f)
            records = reader.read_all()
            reader.close()
        except Exception as e:  # the reader raises bare RuntimeError/ValueError with a C++ message
            raise ValueError(f"cannot read {f!r} as an ArrayRecord file: {e}") from e
        docs.extend((f"{f}:{i}", bytes(r)) for i, r in enumerate(records))
    return docs


def load_documents(source: str, paths: str | None = None) -> list[tuple[str, bytes]]:
    """``[(name, bytes)]`` of one source, in a deterministic order."""
    if source == "embedded":
        return _embedded_documents()
    if source == "text":
        return _text_documents(paths)
    if source == "arrayrecord":
        return _arrayrecord_documents(paths)
    raise ValueError(f"config.data.source={source!r} is not supported; allowed: {list(SOURCES)}")


def _join(parts: list[bytes]) -> np.ndarray:
    out = bytearray()
    for p in parts:
        out += p
        out.append(SEPARATOR)
    return np.frombuffer(bytes(out), dtype=np.uint8)


@functools.lru_cache(maxsize=8)
def token_streams(source: str, paths: str | None, validation_fraction: float) -> dict[str, np.ndarray]:
    """``{"train": uint8[N_train], "validation": uint8[N_val]}`` token streams (read-only, cached)."""
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"config.data.validation_fraction={validation_fraction!r} must be in (0, 1)")
    train, val = [], []
    for _, doc in load_documents(source, paths):
        n_val = round(validation_fraction * len(doc))
        cut = len(doc) - n_val
        if cut > 0:
            train.append(doc[:cut])
        if n_val > 0:
            val.append(doc[cut:])
    streams = {"train": _join(train), "validation": _join(val)}
    for name, s in streams.items():
        if s.size < 2:
            raise ValueError(f"the {name} split of source={source!r} paths={paths!r} is empty")
        s.flags.writeable = False
    return streams
