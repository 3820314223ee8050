"""On-disk token streams for file sources: built once, then memory-mapped; and the document -> tokens encoding.

For the file sources (``source="text"``, ``"arrayrecord"``, ``"jsonl"``, ``"parquet"``) the train and validation
streams are written (one document at a time, never the whole corpus in memory) to
``<cache_dir>/<fingerprint>/{train,validation}.<u8|u16|u32>`` with the token count and the text byte count of each
split in ``meta.json`` and the per-token counts of each split (``meta.json`` for bytes, ``counts.npy`` otherwise),
and opened with ``np.memmap``. The fingerprint is a hash of (format version, source, every input file's path, size
and mtime, validation_fraction, the validation split unless it is "tail", and the tokenizer's identity unless it is
"bytes"): editing a file, changing the split or the tokenizer builds a new cache. Builds go to a temporary directory
renamed into place at the end, so processes sharing a cache directory never see a half-written cache (the loser of
a race discards its copy). Old caches are not deleted.

Every open of an existing cache verifies all of it against ``meta.json``: each stream file's size must be its
token count times the token size, and its ``full_digest`` (:func:`full_digest`: SHA-256 over every byte, in 16 MiB
chunks hashed on parallel threads) must match, and so must that of ``counts.npy`` (``counts_digest``). A
truncated, extended or overwritten stream, any byte of it, any byte of ``counts.npy``, a missing file and a missing
or unreadable ``meta.json`` are damage: the cache is removed with one warning naming the file and rebuilt from the
documents. ``meta.json`` is the reference: an edit of it that stays valid JSON is seen only where it no longer
matches the files (sizes, digests). A cache written by an older lpt has no full digest (only ``digest``, 64 sampled
blocks of 4 KiB, which misses damage between the blocks): it is removed with one warning saying so and rebuilt
once. ``meta.json`` keeps ``digest`` (:func:`digest`) beside ``full_digest`` so that an older lpt still checks a
new cache as it did, and records in ``inputs`` each input file's path, size and :func:`digest` (for
:mod:`lpt.data.identity`; taken once, when the cache is built, at most 256 KiB read per file). A build takes the
digests of the files it wrote and opens them without reading them again.

``cache_dir``: ``config.data.cache_dir`` if set, else ``$LPT_DATA_CACHE``, else ``~/.cache/lpt/data``; one that cannot
hold a new cache (a file, a path that cannot be created, a directory that is not writable) is a one-line ValueError
naming where it came from, the path and why.

How each document divides into the train and validation streams, and how it is encoded: :mod:`lpt.data.documents`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from lpt.data.documents import SPLITS, document_fraction, document_parts, encoded_parts
from lpt.data.tokenizer import token_dtype

_CACHE_VERSION = 1
SAMPLE_BLOCKS, SAMPLE_BYTES = 64, 4096  # the sampled digest reads at most 64 blocks of 4 KiB of a file
DIGEST_CHUNK = 1 << 24  # 16 MiB: full_digest hashes chunks of this size on parallel threads

log = logging.getLogger("lpt.data")


class Corpus(NamedTuple):
    """A split corpus: ``streams`` {split: token ids, read-only (ndarray, memmap or a prepared stream)}, ``counts``
    {split: int64[vocab] occurrences of each id}, ``text_bytes`` {split: UTF-8 bytes + 1 per separator}."""

    streams: dict
    counts: dict[str, np.ndarray]
    text_bytes: dict[str, int]


def _default_cache_dir() -> str:
    return os.environ.get("LPT_DATA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lpt", "data")


def _cache_root(cache_dir: str | None) -> tuple[str, str]:
    """``(directory, where it came from)``: ``cache_dir`` ("data.cache_dir"), else ``$LPT_DATA_CACHE``, else the
    default ``~/.cache/lpt/data`` (module docstring)."""
    if cache_dir:
        return os.path.expanduser(cache_dir), "data.cache_dir"
    if os.environ.get("LPT_DATA_CACHE"):
        return os.environ["LPT_DATA_CACHE"], "$LPT_DATA_CACHE (data.cache_dir is unset)"
    return _default_cache_dir(), "the default data cache (data.cache_dir and $LPT_DATA_CACHE are unset)"


def fingerprint(
    source: str, files: list[str], validation_fraction: float, tokenizer: str = "bytes", validation_split: str = "tail"
) -> str:
    """Cache key; ``tokenizer`` is the tokenizer's identity (a "bytes" cache keeps the key it had without one, and a
    "tail" split the key it had without a split).

    Args:
      source: the data source (``config.data.source``).
      files: the input file paths; each one's absolute path, size and mtime enter the key.
      validation_fraction: share of the text held out for validation.
      tokenizer: the tokenizer's ``identity`` (``"bytes"`` or ``"sha256:..."``).
      validation_split: ``"tail"`` or ``"docs"`` (:data:`lpt.data.documents.VALIDATION_SPLITS`).
    """
    stats = [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]
    fields = [_CACHE_VERSION, source, stats, float(validation_fraction)]
    if tokenizer != "bytes":
        fields.append(tokenizer)
    if validation_split != "tail":
        fields.append(validation_split)
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:24]


class _DamagedCache(ValueError):
    """A cache directory whose streams do not match its ``meta.json``."""


def _suffix(dtype: np.dtype) -> str:
    return {1: "u8", 2: "u16", 4: "u32"}[dtype.itemsize]


def digest(path: str) -> str:
    """blake2b (16 bytes, hex) of the file's size and of ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BYTES`` at evenly
    spaced offsets from the first byte to the last block (the whole file when it is smaller than that). Cheap for
    any size; blind to changes between the blocks (:func:`full_digest` sees every byte)."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as fh:
        if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
            h.update(fh.read())
        else:
            for offset in np.linspace(0, size - SAMPLE_BYTES, SAMPLE_BLOCKS).astype(np.int64):
                fh.seek(int(offset))
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()


def _chunk_digest(fd: int, start: int, stop: int, algorithm: str = "sha256") -> bytes:
    h = hashlib.new(algorithm)
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    pos = start
    while pos < stop:
        n = os.preadv(fd, [view[: min(len(buf), stop - pos)]], pos)
        if n == 0:
            raise OSError(f"{stop - pos} bytes short: the file shrank while it was hashed")
        h.update(view[:n])  # hashlib releases the GIL for large updates: the chunks hash in parallel
        pos += n
    return h.digest()


def _digest_chunks(size: int, chunk_digests: Iterable[bytes]) -> str:
    """The :func:`full_digest` of ``size`` bytes whose ``DIGEST_CHUNK`` chunks have the SHA-256 digests
    ``chunk_digests``."""
    h = hashlib.sha256(str(size).encode())
    for d in chunk_digests:
        h.update(d)
    return h.hexdigest()


def full_digest(path: str | bytes | np.ndarray, threads: int | None = None) -> str:
    """SHA-256 (hex) of the size and of the SHA-256 digests of every ``DIGEST_CHUNK`` chunk of a file (a path) or of
    an in-memory buffer: every byte counts. A file's chunks are read and hashed on ``threads`` threads (default
    ``os.cpu_count()``), 1 MiB at a time each. SHA-256 rather than blake2b: with the SHA instructions of current
    x86 and ARM CPUs it hashes about twice as fast (benchmarks/token_cache_check.py measures both)."""
    if not isinstance(path, str):
        data = memoryview(np.ascontiguousarray(path)).cast("B")
        chunks = range(0, len(data), DIGEST_CHUNK)
        return _digest_chunks(len(data), (hashlib.sha256(data[a : a + DIGEST_CHUNK]).digest() for a in chunks))
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        starts = range(0, size, DIGEST_CHUNK)
        with ThreadPoolExecutor(max(1, min(len(starts), threads or os.cpu_count() or 1))) as pool:
            chunks = list(pool.map(lambda a: _chunk_digest(fd, a, min(size, a + DIGEST_CHUNK)), starts))
    finally:
        os.close(fd)
    return _digest_chunks(size, chunks)


def _input_record(path: str) -> list:
    """``[absolute path, size, digest]`` of an input file, as ``meta.json`` records it in ``inputs``."""
    return [os.path.abspath(path), os.path.getsize(path), digest(path)]


def _write_meta(directory: str, meta: dict, dtype: np.dtype, inputs: Iterable[str]) -> None:
    """``meta.json`` with each split's stream ``digest`` (sampled, read by older lpt) and ``full_digest``, that of
    ``counts.npy`` (``counts_digest``) when there is one, and the ``inputs`` (:func:`_input_record`)."""
    streams = {s: os.path.join(directory, f"{s}.{_suffix(dtype)}") for s in SPLITS}
    meta["digest"] = {s: digest(path) for s, path in streams.items()}
    meta["full_digest"] = {s: full_digest(path) for s, path in streams.items()}
    if os.path.exists(os.path.join(directory, "counts.npy")):
        meta["counts_digest"] = full_digest(os.path.join(directory, "counts.npy"))
    meta["inputs"] = [_input_record(f) for f in inputs]
    with open(os.path.join(directory, "meta.json"), "w") as fh:
        json.dump(meta, fh)


class _OldCache(_DamagedCache):
    """A cache written by an older lpt, without the full digest that every open checks."""


def _verify(directory: str, meta: dict, dtype: np.dtype) -> None:
    """_DamagedCache (one line, naming the file) unless every stream has the size and full digest ``meta`` records,
    and ``counts.npy`` (a tokenizer's cache) its digest; _OldCache when ``meta`` has no full digest."""
    for split in SPLITS:
        path = os.path.join(directory, f"{split}.{_suffix(dtype)}")
        want = int(meta["tokens"][split]) * dtype.itemsize
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size != want:
            found = "missing" if size is None else f"{size} bytes"
            raise _DamagedCache(f"the data cache is damaged: {path} is {found}; its meta.json says {want} bytes")
    if "full_digest" not in meta or "inputs" not in meta:
        raise _OldCache(
            f"the data cache {directory} was written by an older lpt without a full digest (damage between its 64 "
            "sampled blocks would go unseen)"
        )
    checks = {os.path.join(directory, f"{s}.{_suffix(dtype)}"): meta["full_digest"][s] for s in SPLITS}
    if "counts" not in meta:  # a tokenizer's per-id counts live in counts.npy
        checks[os.path.join(directory, "counts.npy")] = meta.get("counts_digest")
    for path, want in checks.items():
        if not os.path.isfile(path):
            raise _DamagedCache(f"the data cache is damaged: {path} is missing")
        if full_digest(path) != want:
            raise _DamagedCache(
                f"the data cache is damaged: {path} does not match the full digest in its meta.json (its bytes were "
                "changed)"
            )


def read_meta(directory: str) -> dict:
    """The ``meta.json`` of the cache ``directory``; _DamagedCache when it is missing or not JSON."""
    try:
        with open(os.path.join(directory, "meta.json")) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise _DamagedCache(f"the data cache is damaged: {os.path.join(directory, 'meta.json')} is missing") from None
    except ValueError:
        path = os.path.join(directory, "meta.json")
        raise _DamagedCache(f"the data cache is damaged: {path} is not valid JSON") from None


def _open(directory: str, verify: bool = True) -> Corpus:
    """The cache in ``directory``, verified (:func:`_verify`) unless ``verify`` is False (this process just wrote
    it and took its digests)."""
    meta = read_meta(directory)
    dtype = np.dtype(meta.get("dtype", "uint8"))
    if verify:
        _verify(directory, meta, dtype)
    streams = {}
    for split in SPLITS:
        path = os.path.join(directory, f"{split}.{_suffix(dtype)}")
        streams[split] = np.memmap(path, dtype=dtype, mode="r") if meta["tokens"][split] else np.zeros(0, dtype)
    if "counts" in meta:  # bytes: 256 counts in meta.json
        counts = {split: np.asarray(meta["counts"][split], np.int64) for split in SPLITS}
    else:
        table = np.load(os.path.join(directory, "counts.npy"))
        counts = {split: table[i] for i, split in enumerate(SPLITS)}
    text_bytes = meta.get("bytes", meta["tokens"])  # bytes: one byte per token
    return Corpus(streams, counts, {split: int(text_bytes[split]) for split in SPLITS})


def _make_tmp(root: str, origin: str, key: str) -> str:
    """A new temporary directory in ``root``; ValueError (one line: ``origin``, the path, why) when ``root`` cannot
    hold one."""
    try:
        os.makedirs(root, exist_ok=True)
        return tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=root)
    except FileExistsError:
        why = "it is a file, not a directory"
    except NotADirectoryError:
        why = "a part of its path is a file, not a directory"
    except OSError as e:
        why = f"{'it is not writable' if os.path.isdir(root) else 'it cannot be created'} ({e.strerror})"
    raise ValueError(
        f"{origin}={root!r} cannot hold the token cache: {why}; set data.cache_dir to a writable directory"
    )


def cache_path(cache_dir: str | None, key: str) -> str:
    """Where the cache of fingerprint ``key`` lives (see :func:`_cache_root`)."""
    return os.path.join(_cache_root(cache_dir)[0], key)


def _build_or_open(cache_dir: str | None, key: str, write: Callable[[str], None]) -> Corpus:
    """Open the verified cache ``<cache_dir>/key``, building it with ``write(tmp_dir)`` when it is missing, damaged
    or written without a full digest."""
    root, origin = _cache_root(cache_dir)
    final = os.path.join(root, key)
    if os.path.isdir(final):
        try:
            return _open(final)
        except _DamagedCache as e:
            log.warning("%s; removing %s and rebuilding it", e, final)
            try:
                aside = tempfile.mkdtemp(prefix=f"{key}.damaged-", dir=root)
            except OSError:  # root is not writable: _make_tmp below says so
                aside = None
            if aside is not None:
                try:
                    os.rename(final, os.path.join(aside, key))  # atomic: no reader sees a half-deleted cache
                except OSError:  # another process moved it first
                    pass
                shutil.rmtree(aside, ignore_errors=True)
    tmp = _make_tmp(root, origin, key)
    try:
        write(tmp)
        try:
            os.rename(tmp, final)
            ours = True
        except OSError:  # another process finished first: use its cache
            shutil.rmtree(tmp, ignore_errors=True)
            ours = False
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _open(final, verify=not ours)


def build_or_open(
    key: str,
    documents: Callable[[], Iterable[bytes | str]],
    validation_fraction: float,
    separator: int,
    cache_dir: str | None = None,
    validation_split: str = "tail",
    inputs: Iterable[str] = (),
) -> Corpus:
    """Memory-mapped uint8 byte streams (the bytes tokenizer) and their counts for the fingerprint ``key``.

    ``documents()`` yields the documents in order, each as bytes or as the path of a file holding it; it is only
    called when the cache does not exist yet. ``inputs``: the input files, recorded in ``meta.json``.

    Args:
      key: the cache's fingerprint (:func:`fingerprint`), its directory name under the cache root.
      documents: called with no arguments, yields the documents as bytes or file paths.
      validation_fraction: share held out for validation.
      separator: the byte written after each non-empty part (0..255).
      cache_dir: the cache root; None: ``$LPT_DATA_CACHE``, else ``~/.cache/lpt/data`` (:func:`_cache_root`).
      validation_split: ``"tail"`` or ``"docs"`` (:data:`lpt.data.documents.VALIDATION_SPLITS`).
      inputs: the input file paths.
    """

    def write(tmp: str) -> None:
        counts = {s: np.zeros(256, np.int64) for s in SPLITS}
        sizes = dict.fromkeys(SPLITS, 0)
        sep = bytes([separator])
        with open(os.path.join(tmp, "train.u8"), "wb") as ft, open(os.path.join(tmp, "validation.u8"), "wb") as fv:
            for doc in documents():
                parts = document_parts(doc, document_fraction(doc, validation_fraction, validation_split))
                for split, pieces, fh in zip(SPLITS, parts, (ft, fv), strict=True):
                    n = 0
                    for piece in pieces:
                        fh.write(piece)
                        counts[split] += np.bincount(np.frombuffer(piece, np.uint8), minlength=256)
                        n += len(piece)
                    if n:  # an empty part gets no separator either
                        fh.write(sep)
                        counts[split][separator] += 1
                        sizes[split] += n + 1
        meta = {"version": _CACHE_VERSION, "tokens": sizes, "counts": {s: counts[s].tolist() for s in SPLITS}}
        _write_meta(tmp, meta, np.dtype(np.uint8), inputs)

    return _build_or_open(cache_dir, key, write)


class TokenCounter:
    """Checks, casts and counts the token ids of one split: ``add(ids, nbytes) -> dtype array``."""

    def __init__(self, tokenizer, dtype: np.dtype):
        self.vocab_size, self.dtype, self.name = tokenizer.vocab_size, dtype, tokenizer.name
        self.counts = np.zeros(tokenizer.vocab_size, np.int64)
        self.tokens = self.text_bytes = 0

    def add(self, ids, nbytes: int) -> np.ndarray:
        a = np.asarray(ids, dtype=np.int64)
        if a.size and (a.min() < 0 or a.max() >= self.vocab_size):
            raise ValueError(f"data.tokenizer={self.name!r} produced id {a.max()} outside its vocab_size")
        self.counts += np.bincount(a, minlength=self.vocab_size)
        self.tokens += a.size
        self.text_bytes += nbytes
        return a.astype(self.dtype)  # int64 ids -> the stream's uint16 / uint32 (range checked above)


def build_or_open_tokens(
    key: str,
    documents: Callable[[], Iterable[tuple[str, bytes | str]]],
    validation_fraction: float,
    tokenizer,
    cache_dir: str | None = None,
    validation_split: str = "tail",
    inputs: Iterable[str] = (),
) -> Corpus:
    """Memory-mapped token streams of ``tokenizer`` (uint16 / uint32, :func:`lpt.data.tokenizer.token_dtype`), their
    counts (``counts.npy``) and text bytes for the fingerprint ``key``. ``documents()`` yields ``(name, bytes or file
    path)`` in order; it is only called when the cache does not exist yet. ``inputs``: the input files, recorded in
    ``meta.json``.

    Args:
      key: the cache's fingerprint (:func:`fingerprint`), its directory name under the cache root.
      documents: called with no arguments, yields ``(name, document)``; ``name`` appears in errors.
      validation_fraction: share held out for validation.
      tokenizer: a tokenizer of :mod:`lpt.data.tokenizer`; ids outside its ``vocab_size`` are a ValueError.
      cache_dir: the cache root; None: ``$LPT_DATA_CACHE``, else ``~/.cache/lpt/data`` (:func:`_cache_root`).
      validation_split: ``"tail"`` or ``"docs"`` (:data:`lpt.data.documents.VALIDATION_SPLITS`).
      inputs: the input file paths.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    suffix = _suffix(dtype)

    def write(tmp: str) -> None:
        counters = {s: TokenCounter(tokenizer, dtype) for s in SPLITS}
        with (
            open(os.path.join(tmp, f"train.{suffix}"), "wb") as ft,
            open(os.path.join(tmp, f"validation.{suffix}"), "wb") as fv,
        ):
            files = {"train": ft, "validation": fv}
            for name, doc in documents():
                for split, ids, nbytes in encoded_parts(tokenizer, doc, validation_fraction, name, validation_split):
                    files[split].write(counters[split].add(ids, nbytes).tobytes())
        np.save(os.path.join(tmp, "counts.npy"), np.stack([counters[s].counts for s in SPLITS]))
        meta = {
            "version": _CACHE_VERSION,
            "tokenizer": tokenizer.identity,
            "vocab_size": tokenizer.vocab_size,
            "dtype": dtype.name,
            "tokens": {s: counters[s].tokens for s in SPLITS},
            "bytes": {s: counters[s].text_bytes for s in SPLITS},
        }
        _write_meta(tmp, meta, dtype, inputs)

    return _build_or_open(cache_dir, key, write)
