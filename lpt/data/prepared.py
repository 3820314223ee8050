"""The ``"prepared"`` data source: a directory written by ``python -m lpt.data.prepare``, read with random access.

Layout of the directory (``config.data.paths``):

* ``manifest.json``: format, the tokenizer (spec, identity, vocab_size, separator), the token dtype, the input
  source and its text_field, validation_fraction and validation_split, ``record_tokens``, the shard plan (each
  shard's input files with size and mtime), the finished shards with their token, byte, document and bad record
  counts, the totals, and ``complete``. A manifest without validation_split / text_field reads as "tail" and
  no field.
* per shard ``i``: ``train-iiiii.array_record`` and ``validation-iiiii.array_record`` and ``counts-iiiii.npy``
  (int64[2, vocab]: how often each id occurs in the shard's train / validation tokens); ``counts.npy``: their sum,
  written when the last shard is done.

A split's token stream is the concatenation, in shard order, of the shards' streams of that split, each of which is
the concatenation of its documents' parts, each followed by the separator (exactly the stream the on-the-fly path
builds from the same documents and tokenizer). Each shard stores its stream in records of ``record_tokens`` ids
(the last record of a shard may be shorter; raw little-endian uint16 / uint32; ArrayRecord ``group_size:1``, so
every record is read on its own). :class:`PreparedStream` maps a token position to (shard, record) with the
cumulative token counts of the manifest and reads only the records a window touches (a window of ``seq_len + 1 ≤
record_tokens`` ids touches at most two), through grain's ``ArrayRecordDataSource``; nothing is loaded into RAM
beyond a few recent records.
"""

from __future__ import annotations

import collections
import json
import os
import threading

import numpy as np

from lpt.data.cache import Corpus
from lpt.data.documents import SPLITS

MANIFEST = "manifest.json"
TOTAL_COUNTS = "counts.npy"
FORMAT = 1


def shard_file(split: str, index: int) -> str:
    return f"{split}-{index:05d}.array_record"


def counts_file(index: int) -> str:
    return f"counts-{index:05d}.npy"


def read_manifest(directory: str) -> dict:
    """The manifest of a prepared directory; ValueError if there is none or it is not a manifest this code reads."""
    path = os.path.join(os.path.expanduser(str(directory)), MANIFEST)
    if not os.path.isfile(path):
        raise ValueError(
            f"config.data.paths={directory!r} is not a prepared directory (no {MANIFEST}); make one with "
            "python -m lpt.data.prepare --tokenizer T --input GLOB --out DIR"
        )
    with open(path) as fh:
        manifest = json.load(fh)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}; this lpt reads format {FORMAT}")
    return manifest


class PreparedStream:
    """One split of a prepared directory as a read-only 1-D token array: ``size``, ``dtype``, ``len()``,
    ``stream[i]`` and ``stream[a:b]`` (contiguous slices; a numpy array). Pickles as (directory, split)."""

    _CACHED_RECORDS = 8

    def __init__(self, directory: str, split: str):
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; allowed: {list(SPLITS)}")
        self.directory, self.split = os.path.expanduser(str(directory)), split
        manifest = read_manifest(self.directory)
        self.dtype = np.dtype(manifest["dtype"]).newbyteorder("<")  # records are little-endian
        self.record_tokens = int(manifest["record_tokens"])
        finished = manifest["finished"]
        shards = [(s["index"], int(finished[str(s["index"])]["tokens"][split])) for s in manifest["shards"]]
        shards = [(i, n) for i, n in shards if n]  # a shard without tokens of this split adds no file
        self._files = [os.path.join(self.directory, shard_file(split, i)) for i, _ in shards]
        tokens = np.array([n for _, n in shards], np.int64)
        records = -(-tokens // self.record_tokens)  # ceil
        self._token_starts = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        self._record_starts = np.concatenate([[0], np.cumsum(records)]).astype(np.int64)
        self.size = int(self._token_starts[-1])
        self._source = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    def __len__(self) -> int:
        return self.size

    def __reduce__(self):
        return (PreparedStream, (self.directory, self.split))

    def _record(self, r: int) -> np.ndarray:
        with self._lock:
            if r in self._cache:
                self._cache.move_to_end(r)
                return self._cache[r]
            if self._source is None:
                import grain

                self._source = grain.sources.ArrayRecordDataSource(self._files)
        rec = np.frombuffer(self._source[r], dtype=self.dtype)
        with self._lock:
            self._cache[r] = rec
            while len(self._cache) > self._CACHED_RECORDS:
                self._cache.popitem(last=False)
        return rec

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` (clipped to the stream)."""
        start, stop = max(0, int(start)), min(self.size, int(stop))
        out = np.empty(max(0, stop - start), self.dtype)
        pos = start
        while pos < stop:
            shard = int(np.searchsorted(self._token_starts, pos, side="right")) - 1
            local = pos - int(self._token_starts[shard])
            r, offset = divmod(local, self.record_tokens)
            rec = self._record(int(self._record_starts[shard]) + r)
            n = min(rec.size - offset, stop - pos)
            out[pos - start : pos - start + n] = rec[offset : offset + n]
            pos += n
        return out

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self.size)
            if step != 1:
                raise ValueError(f"PreparedStream supports contiguous slices only, not step {step}")
            return self.read(start, stop)
        i = int(key)
        if not -self.size <= i < self.size:
            raise IndexError(f"index {i} out of range for a stream of {self.size} tokens")
        return self.read(i % self.size, i % self.size + 1)[0]


def open_corpus(directory: str | None, tokenizer, validation_fraction: float) -> Corpus:
    """The prepared directory as a :class:`lpt.data.cache.Corpus`; ValueError in one line if it is unfinished, or
    was prepared with another tokenizer (by identity) or another validation_fraction."""
    if not directory or not isinstance(directory, str):
        raise ValueError(f"config.data.paths={directory!r}: source='prepared' needs the directory prepare wrote")
    manifest = read_manifest(directory)
    tok = manifest["tokenizer"]
    if tok["identity"] != tokenizer.identity:
        raise ValueError(
            f"config.data.tokenizer={tokenizer.name!r} ({tokenizer.identity}) is not the tokenizer {directory!r} was "
            f"prepared with ({tok['spec']!r}, {tok['identity']}); set data.tokenizer to that one"
        )
    if float(manifest["validation_fraction"]) != validation_fraction:
        raise ValueError(
            f"config.data.validation_fraction={validation_fraction!r}, but {directory!r} was prepared with "
            f"{manifest['validation_fraction']!r}; set it to that value"
        )
    if not manifest.get("complete"):
        raise ValueError(
            f"{directory!r} is unfinished ({len(manifest['finished'])} of {len(manifest['shards'])} shards); rerun "
            "python -m lpt.data.prepare with the same arguments to finish it"
        )
    counts = np.load(os.path.join(os.path.expanduser(directory), TOTAL_COUNTS))
    streams = {split: PreparedStream(directory, split) for split in SPLITS}
    return Corpus(
        streams, {split: counts[i] for i, split in enumerate(SPLITS)}, {s: int(manifest["bytes"][s]) for s in SPLITS}
    )
