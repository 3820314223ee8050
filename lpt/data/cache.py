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
from collections.abc import Callable, Iterable

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
    documents: Callable[[], Iterable[bytes]],
    validation_fraction: float,
    separator: int,
    cache_dir: str | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Memory-mapped ``{split: uint8 stream}`` and ``{split: int64[256] byte counts}`` for the fingerprint ``key``.

    ``documents()`` yields the documents' bytes in order; it is only called when the cache does not exist yet.
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
                    for split, part, fh in zip(SPLITS, split_document(doc, validation_fraction), (ft, fv), strict=True):
                        if not part:
                            continue
                        fh.write(part)
                        fh.write(sep)
                        counts[split] += np.bincount(np.frombuffer(part, np.uint8), minlength=256)
                        counts[split][separator] += 1
                        sizes[split] += len(part) + 1
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
