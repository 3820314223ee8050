"""On-disk token streams for file sources: built once, then memory-mapped.

For ``source="text"`` / ``"arrayrecord"`` the train and validation streams are written (one document at a time,
never the whole corpus in memory) to ``<cache_dir>/<fingerprint>/{train,validation}.u8`` with the byte counts of
each split in ``meta.json``, and opened with ``np.memmap``. The fingerprint is a hash of (format version, source,
every input file's path, size and mtime, validation_fraction): editing a file or changing the split builds a new
cache. Builds go to a temporary directory renamed into place at the end, so processes sharing a cache directory
never see a half-written cache (the loser of a race discards its copy). Old caches are not deleted.

``cache_dir``: ``config.data.cache_dir`` if set, else ``$LPT_DATA_CACHE``, else ``~/.cache/lpt/data``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator

import numpy as np

CACHE_VERSION = 1
SPLITS = ("train", "validation")


def default_cache_dir() -> str:
    return os.environ.get("LPT_DATA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lpt", "data")


def fingerprint(source: str, files: list[str], validation_fraction: float) -> str:
    stats = [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]
    blob = json.dumps([CACHE_VERSION, source, stats, float(validation_fraction)]).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def split_document(doc: bytes, validation_fraction: float) -> tuple[bytes, bytes]:
    """(train part, validation part): the last ``round(f · len)`` bytes go to validation."""
    cut = len(doc) - round(validation_fraction * len(doc))
    return doc[:cut], doc[cut:]


CHUNK_BYTES = 1 << 26  # 64 MiB: files are copied into the cache in pieces of this size


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


def document_parts(doc: bytes | str, validation_fraction: float) -> tuple[Iterable[bytes], Iterable[bytes]]:
    """(train pieces, validation pieces) of one document, given as bytes or as a file path (read in pieces, so a
    single huge file never sits in memory). Same cut as :func:`split_document`."""
    if isinstance(doc, bytes | bytearray):
        train, val = split_document(bytes(doc), validation_fraction)
        return [train], [val]
    size = os.path.getsize(doc)
    cut = size - round(validation_fraction * size)
    return _read_range(doc, 0, cut), _read_range(doc, cut, size)


def _open(directory: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    with open(os.path.join(directory, "meta.json")) as fh:
        meta = json.load(fh)
    streams, counts = {}, {}
    for split in SPLITS:
        path = os.path.join(directory, f"{split}.u8")
        streams[split] = np.memmap(path, dtype=np.uint8, mode="r") if meta["tokens"][split] else np.zeros(0, np.uint8)
        counts[split] = np.asarray(meta["counts"][split], np.int64)
    return streams, counts


def build_or_open(
    key: str,
    documents: Callable[[], Iterable[bytes | str]],
    validation_fraction: float,
    separator: int,
    cache_dir: str | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Memory-mapped ``{split: uint8 stream}`` and ``{split: int64[256] byte counts}`` for the fingerprint ``key``.

    ``documents()`` yields the documents in order, each as bytes or as the path of a file holding it; it is only
    called when the cache does not exist yet.
    """
    root = cache_dir or default_cache_dir()
    final = os.path.join(root, key)
    if not os.path.exists(os.path.join(final, "meta.json")):
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=root)
        try:
            counts = {s: np.zeros(256, np.int64) for s in SPLITS}
            sizes = dict.fromkeys(SPLITS, 0)
            sep = bytes([separator])
            with open(os.path.join(tmp, "train.u8"), "wb") as ft, open(os.path.join(tmp, "validation.u8"), "wb") as fv:
                for doc in documents():
                    for split, pieces, fh in zip(
                        SPLITS, document_parts(doc, validation_fraction), (ft, fv), strict=True
                    ):
                        n = 0
                        for piece in pieces:
                            fh.write(piece)
                            counts[split] += np.bincount(np.frombuffer(piece, np.uint8), minlength=256)
                            n += len(piece)
                        if n:  # an empty part gets no separator either
                            fh.write(sep)
                            counts[split][separator] += 1
                            sizes[split] += n + 1
            meta = {"version": CACHE_VERSION, "tokens": sizes, "counts": {s: counts[s].tolist() for s in SPLITS}}
            with open(os.path.join(tmp, "meta.json"), "w") as fh:
                json.dump(meta, fh)
            try:
                os.rename(tmp, final)
            except OSError:  # another process finished first: use its cache
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return _open(final)
