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

The embedded corpus lives in memory; file sources are streamed once into an on-disk cache and memory-mapped
(:mod:`lpt.data.cache`), so neither the corpus nor grain's worker processes hold it in RAM.
"""

from __future__ import annotations

import functools
import glob as globlib
import os
from collections.abc import Iterator

import numpy as np

from lpt.data import cache

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


def _iter_text(files: list[str]) -> Iterator[tuple[str, bytes]]:
    for f in files:
        with open(f, "rb") as fh:
            yield f, fh.read()


def _iter_arrayrecord(files: list[str]) -> Iterator[tuple[str, bytes]]:
    from array_record.python.array_record_module import ArrayRecordReader

    for f in files:
        try:
            reader = ArrayRecordReader(f)
            records = reader.read_all()
            reader.close()
        except Exception as e:  # the reader raises bare RuntimeError/ValueError with a C++ message
            raise ValueError(f"cannot read {f!r} as an ArrayRecord file: {e}") from e
        for i, r in enumerate(records):
            yield f"{f}:{i}", bytes(r)


_FILE_SOURCES = {"text": _iter_text, "arrayrecord": _iter_arrayrecord}


def load_documents(source: str, paths: str | None = None) -> list[tuple[str, bytes]]:
    """``[(name, bytes)]`` of one source, in a deterministic order (all in memory: for inspection and tests)."""
    if source == "embedded":
        return _embedded_documents()
    if source in _FILE_SOURCES:
        return list(_FILE_SOURCES[source](_glob(paths, source)))
    raise ValueError(f"config.data.source={source!r} is not supported; allowed: {list(SOURCES)}")


def _join(parts: list[bytes]) -> np.ndarray:
    out = bytearray()
    for p in parts:
        out += p
        out.append(SEPARATOR)
    return np.frombuffer(bytes(out), dtype=np.uint8)


def _check(streams: dict, source: str, paths) -> None:
    for name, s in streams.items():
        if s.size < 2:
            raise ValueError(f"the {name} split of source={source!r} paths={paths!r} is empty")


@functools.lru_cache(maxsize=4)
def _embedded_streams(validation_fraction: float):
    parts = {"train": [], "validation": []}
    for _, doc in _embedded_documents():
        train, val = cache.split_document(doc, validation_fraction)
        for split, part in (("train", train), ("validation", val)):
            if part:
                parts[split].append(part)
    streams = {split: _join(p) for split, p in parts.items()}
    for s in streams.values():
        s.flags.writeable = False
    counts = {split: np.bincount(s, minlength=VOCAB_SIZE).astype(np.int64) for split, s in streams.items()}
    return streams, counts


@functools.lru_cache(maxsize=8)
def _file_streams(source: str, files: tuple[str, ...], key: str, validation_fraction: float, cache_dir: str | None):
    if source == "text":
        docs = lambda: iter(files)  # paths: the cache copies each file in pieces
    else:
        docs = lambda: (doc for _, doc in _FILE_SOURCES[source](list(files)))
    return cache.build_or_open(key, docs, validation_fraction, SEPARATOR, cache_dir)


def streams_and_counts(
    source: str, paths: str | None, validation_fraction: float, cache_dir: str | None = None
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``({split: uint8 stream}, {split: int64[256] byte counts})``, read-only.

    The embedded corpus is built in memory (once per process); file sources go through the on-disk cache
    (:mod:`lpt.data.cache`), looked up by the files' current fingerprint on every call.
    """
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"config.data.validation_fraction={validation_fraction!r} must be in (0, 1)")
    if source == "embedded":
        streams, counts = _embedded_streams(float(validation_fraction))
    elif source in _FILE_SOURCES:
        files = tuple(_glob(paths, source))
        key = cache.fingerprint(source, list(files), validation_fraction)
        streams, counts = _file_streams(source, files, key, float(validation_fraction), cache_dir)
    else:
        raise ValueError(f"config.data.source={source!r} is not supported; allowed: {list(SOURCES)}")
    _check(streams, source, paths)
    return streams, counts


def token_streams(
    source: str, paths: str | None, validation_fraction: float, cache_dir: str | None = None
) -> dict[str, np.ndarray]:
    """``{"train": uint8[N_train], "validation": uint8[N_val]}`` token streams (read-only, cached)."""
    return streams_and_counts(source, paths, validation_fraction, cache_dir)[0]
