"""Documents -> tokens -> train / validation token streams.

Sources (``config.data.source``):

* ``"embedded"``: the English help texts CPython ships as ``pydoc_data.topics`` (no download), in sorted topic
  order, with repeated paragraphs removed (:func:`_dedupe_paragraphs`). The topics overlap heavily ("specialnames"
  contains "customization", "compound" contains "if", ...), so without the dedupe much of the validation split
  occurs verbatim in the train split (sizes and overlap: docs/models_and_data.md).
* ``"text"``: every file matching the glob ``config.data.paths`` (``**`` recursive), sorted by path; one file is
  one document (its raw bytes).
* ``"arrayrecord"``: every record of every ArrayRecord file matching ``config.data.paths`` (sorted); one record is
  one document (raw bytes, e.g. UTF-8 text).
* ``"jsonl"``: every line of every JSON Lines file matching ``config.data.paths`` (``.gz`` / ``.zst`` decompressed)
  is one document, its ``"text"`` field; ``"parquet"``: every row of every Parquet file, its ``"text"`` column
  (:mod:`lpt.data.records`: streamed; a bad record is skipped with a warning naming its file and line, and more
  than ``lpt.data.records.MAX_BAD_RECORDS`` of them are an error).
* ``"prepared"``: a directory written by ``python -m lpt.data.prepare`` (``config.data.paths`` = the directory):
  token ids already split and packed, read with random access from ArrayRecord shards (:mod:`lpt.data.prepared`).

Tokens (``config.data.tokenizer``, :mod:`lpt.data.tokenizer`): with ``"bytes"`` (the default) the tokens are the
bytes (vocab 256, uint8 streams) and documents are joined with the separator token 0 (NUL, absent from text) after
each document: ``doc₀ 0 doc₁ 0 …``. With a tokenizer file each document part is encoded by it and followed by the
tokenizer's separator id; streams are uint16 when the vocabulary fits, else uint32
(:func:`lpt.data.documents.encoded_parts`).

The file sources are the registry :data:`_FILE_SOURCES` (name -> :class:`_FileFormat`: the reader, the file names
that select it in ``python -m lpt.data.prepare``, the default validation split), shared with that tool.

Split (the ``split`` of the source's :class:`_FileFormat`): ``"tail"`` (embedded, text, arrayrecord): the last
``validation_fraction`` of each document's bytes (``cut = len − round(f · len)``; with a tokenizer moved forward to
the next UTF-8 character boundary) goes to the validation stream, the rest to the train stream; deterministic,
disjoint, exact in proportion, and it works for a single large file as well as for many small ones. ``"docs"``
(jsonl, parquet: many small documents): whole documents go to validation, those whose content hash falls below the
fraction (:func:`lpt.data.documents.holds_out`): held-out text is never trained on, and identical documents share a
split.

The embedded corpus lives in memory; file sources are streamed once into an on-disk cache and memory-mapped
(:mod:`lpt.data.cache`), so neither the corpus nor grain's worker processes hold it in RAM.
"""

from __future__ import annotations

import fnmatch
import functools
import glob as globlib
import os
import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

from lpt.data import cache, documents, prepared, records
from lpt.data.cache import Corpus
from lpt.data.documents import SPLITS
from lpt.data.tokenizer import load_tokenizer, token_dtype

SEPARATOR = 0
_VOCAB_SIZE = 256


def _dedupe_paragraphs(docs: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
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
    return _dedupe_paragraphs(docs)


def glob_files(pattern: str | None, source: str, option: str = "config.data.paths") -> list[str]:
    """The files the glob ``pattern`` matches (``~`` expanded, ``**`` recursive, directories left out), sorted.

    ValueError when ``pattern`` is not a non-empty string or matches no files, naming ``option``, where the pattern
    came from: a config key (``config.data.paths='x/*.txt'``) or a command-line flag (``--input 'x/*.txt'``)."""
    given = f"{option} {pattern!r}" if option.startswith("-") else f"{option}={pattern!r}"
    if not pattern or not isinstance(pattern, str):
        raise ValueError(f"{given}: source={source!r} needs a glob string of input files")
    files = sorted(f for f in globlib.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(f))
    if not files:
        raise ValueError(f"{given} matches no files (source={source!r})")
    return files


def _glob_parts(pattern: str) -> tuple[str, list[str]]:
    """``(the directory the glob starts in, the components after it)``: the start is the absolute path of the
    components before the first one with a wildcard (a pattern without wildcards: its directory)."""
    parts = os.path.abspath(os.path.expanduser(pattern)).split(os.sep)
    first = next((i for i, part in enumerate(parts) if globlib.has_magic(part)), len(parts) - 1)
    return os.sep.join(parts[:first]) or os.sep, parts[first:]


def glob_root(pattern: str) -> str:
    """The absolute directory the glob ``pattern`` starts in (its part before the first wildcard)."""
    return _glob_parts(pattern)[0]


def _match(pattern: list[str], names: list[str]) -> bool:
    if not pattern:
        return not names
    head, rest = pattern[0], pattern[1:]
    if head == "**":  # recursive: any number of directories, none included
        return any(_match(rest, names[i:]) for i in range(len(names) + 1))
    return bool(names) and fnmatch.fnmatchcase(names[0], head) and _match(rest, names[1:])


def glob_matches(pattern: str, path: str) -> bool:
    """Whether :func:`glob_files` of ``pattern`` would match the file ``path`` were it there (symlinks followed in
    both; a ``*`` is also taken to match names that start with a dot, so it errs on the side of a match)."""
    root, rest = _glob_parts(pattern)
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(root))
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        return False
    return _match(rest, rel.split(os.sep))


def _iter_text(files: list[str], text_field: str = "text", bad=None) -> Iterator[tuple[str, bytes]]:
    for f in files:
        with open(f, "rb") as fh:
            yield f, fh.read()


def _iter_arrayrecord(files: list[str], text_field: str = "text", bad=None) -> Iterator[tuple[str, bytes]]:
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


class _FileFormat(NamedTuple):
    """A file source. ``read(files, text_field, bad)`` yields ``(name, document bytes)`` in order (``bad``: a
    :class:`lpt.data.records.BadRecords`); ``names``: the regex (searched, case-insensitive) of the file names that
    select it when no source is named (None: any other name); ``split``: its default validation split;
    ``text_field``: whether it reads a named field of each record."""

    read: Callable[..., Iterator[tuple[str, bytes]]]
    names: str | None
    split: str
    text_field: bool


_FILE_SOURCES = {
    "text": _FileFormat(_iter_text, None, "tail", False),
    "arrayrecord": _FileFormat(_iter_arrayrecord, r"\.array_?record(-\d+-of-\d+)?$", "tail", False),
    "jsonl": _FileFormat(records.read_jsonl, r"\.(jsonl|ndjson)(\.gz|\.zst)?$", "docs", True),
    "parquet": _FileFormat(records.read_parquet, r"\.parquet$", "docs", True),
}
SOURCES = ("embedded", *_FILE_SOURCES, "prepared")


def infer_source(files: list[str], option: str = "--input") -> str:
    """The file source whose ``names`` match every one of ``files`` ("text" for names no format claims);
    ValueError naming a file of each format when they differ."""
    found: dict[str, str] = {}
    for f in files:
        kind = next((k for k, v in _FILE_SOURCES.items() if v.names and re.search(v.names, f, re.IGNORECASE)), "text")
        found.setdefault(kind, f)
    if len(found) > 1:
        which = ", ".join(f"{k}: {f!r}" for k, f in found.items())
        raise ValueError(f"{option} matches files of several formats ({which}); name one with --source")
    return next(iter(found))


def load_documents(source: str, paths: str | None = None) -> list[tuple[str, bytes]]:
    """``[(name, bytes)]`` of one source, in a deterministic order (all in memory: for inspection and tests)."""
    if source == "embedded":
        return _embedded_documents()
    if source in _FILE_SOURCES:
        return list(_FILE_SOURCES[source].read(glob_files(paths, source)))
    if source == "prepared":
        raise ValueError(f"source='prepared' (paths={paths!r}) holds token ids, not documents")
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
            why = ""
            if source in _FILE_SOURCES and _FILE_SOURCES[source].split == "docs":
                why = " (this source holds out whole documents: too few of them for validation_fraction)"
            raise ValueError(f"the {name} split of source={source!r} paths={paths!r} is empty{why}")


@functools.lru_cache(maxsize=4)
def _embedded_streams(validation_fraction: float) -> Corpus:
    parts = {"train": [], "validation": []}
    for _, doc in _embedded_documents():
        train, val = documents.split_document(doc, validation_fraction)
        for split, part in (("train", train), ("validation", val)):
            if part:
                parts[split].append(part)
    streams = {split: _join(p) for split, p in parts.items()}
    for s in streams.values():
        s.flags.writeable = False
    counts = {split: np.bincount(s, minlength=_VOCAB_SIZE).astype(np.int64) for split, s in streams.items()}
    return Corpus(streams, counts, {split: int(s.size) for split, s in streams.items()})


@functools.lru_cache(maxsize=4)
def _embedded_tokens(validation_fraction: float, tokenizer: str, identity: str) -> Corpus:
    tok = load_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    counters = {s: cache.TokenCounter(tok, dtype) for s in SPLITS}
    parts = {s: [] for s in SPLITS}
    for name, doc in _embedded_documents():
        for split, ids, nbytes in documents.encoded_parts(tok, doc, validation_fraction, name):
            parts[split].append(counters[split].add(ids, nbytes))
    streams = {s: np.concatenate(parts[s]) if parts[s] else np.zeros(0, dtype) for s in SPLITS}
    for s in streams.values():
        s.flags.writeable = False
    return Corpus(streams, {s: counters[s].counts for s in SPLITS}, {s: counters[s].text_bytes for s in SPLITS})


@functools.lru_cache(maxsize=8)
def _file_streams(
    source: str, files: tuple[str, ...], key: str, validation_fraction: float, cache_dir: str | None, tokenizer: str
) -> Corpus:
    split = _FILE_SOURCES[source].split
    if source == "text":
        named = lambda: ((f, f) for f in files)  # paths: read (and encoded) in pieces
    else:
        named = lambda: _FILE_SOURCES[source].read(list(files), "text", records.BadRecords())
    if tokenizer == "bytes":
        docs = lambda: (doc for _, doc in named())
        return cache.build_or_open(key, docs, validation_fraction, SEPARATOR, cache_dir, split, files)
    tok = load_tokenizer(tokenizer)
    return cache.build_or_open_tokens(key, named, validation_fraction, tok, cache_dir, split, files)


def load_corpus(
    source: str,
    paths: str | None,
    validation_fraction: float,
    cache_dir: str | None = None,
    tokenizer: str = "bytes",
) -> Corpus:
    """The split corpus of one source and tokenizer: :class:`lpt.data.cache.Corpus` (streams, per-id counts, text
    bytes), read-only. ``streams`` is ``{"train": ids[N_train], "validation": ids[N_val]}``: uint8 for ``"bytes"``,
    else uint16 / uint32; for ``"prepared"`` random-access :class:`lpt.data.prepared.PreparedStream` objects.

    The embedded corpus is built in memory (once per process and tokenizer); file sources go through the on-disk
    cache (:mod:`lpt.data.cache`), looked up by the files' current fingerprint and the tokenizer's identity on every
    call; ``"prepared"`` opens the directory ``paths`` and checks that ``tokenizer`` and ``validation_fraction`` are
    the ones it was prepared with.

    Args:
      source: one of :data:`SOURCES` (``config.data.source``).
      paths: glob of the input files of a file source, or the prepared directory; unused for ``"embedded"``.
      validation_fraction: share held out for validation, in (0, 1).
      cache_dir: root of the on-disk cache of the file sources; None: ``$LPT_DATA_CACHE``, else ``~/.cache/lpt/data``.
      tokenizer: ``config.data.tokenizer``: ``"bytes"`` or a tokenizer file (:func:`lpt.data.tokenizer.load_tokenizer`).
    """
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"config.data.validation_fraction={validation_fraction!r} must be in (0, 1)")
    tok = load_tokenizer(tokenizer)
    if source == "embedded":
        if tok.identity == "bytes":
            corpus = _embedded_streams(float(validation_fraction))
        else:
            corpus = _embedded_tokens(float(validation_fraction), str(tokenizer), tok.identity)
    elif source in _FILE_SOURCES:
        files = tuple(glob_files(paths, source))
        key = cache.fingerprint(source, list(files), validation_fraction, tok.identity, _FILE_SOURCES[source].split)
        corpus = _file_streams(source, files, key, float(validation_fraction), cache_dir, str(tokenizer))
    elif source == "prepared":
        corpus = prepared.open_corpus(paths, tok, float(validation_fraction))
    else:
        raise ValueError(f"config.data.source={source!r} is not supported; allowed: {list(SOURCES)}")
    _check(corpus.streams, source, paths)
    return corpus
