"""The output directory of ``python -m lpt.data.prepare``: its manifest, its lock, its place apart from the input.

* The manifest (``DIR/manifest.json``, :data:`lpt.data.prepared.MANIFEST`): :func:`read_manifest`,
  :func:`write_manifest` (through a temporary file and a rename), :func:`check_rerun` (a rerun into the same DIR must
  have the same tokenizer, inputs and settings) and :func:`remove_temporary` (the half-written files an
  interrupted run leaves).
* :class:`OutLock`: one prepare at a time per DIR (an exclusive lock on ``DIR/prepare.lock`` that names the holder).
* :func:`check_apart`: DIR must not be, contain, or lie inside an input directory where the ``--input`` glob would
  match the files prepare writes.
"""

from __future__ import annotations

import json
import os
import re

from lpt import filelock
from lpt.data import corpus, documents, prepared

_TEMPORARY = re.compile(
    r"(train|validation)-\d{5}\.array_record\.tmp-\d+|(counts-\d{5}|counts)\.npy\.tmp\.npy|manifest\.json\.tmp"
)


def remove_temporary(out: str) -> None:
    """Delete the half-written files (temporary names) that an interrupted prepare left in ``out``."""
    for f in os.listdir(out):
        if _TEMPORARY.fullmatch(f):
            os.remove(os.path.join(out, f))


def read_manifest(path: str) -> dict:
    """An existing ``manifest.json``; ValueError naming it when it is not a JSON object."""
    try:
        with open(path, "rb") as fh:
            manifest = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a prepare manifest (not JSON: {e}); use another --out") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} is not a prepare manifest (not a JSON object); use another --out")
    return manifest


def write_manifest(out: str, manifest: dict) -> None:
    path = os.path.join(out, prepared.MANIFEST)
    with open(path + ".tmp", "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def check_rerun(out: str, old: dict, new: dict) -> None:
    if old.get("format") != prepared.FORMAT:
        raise ValueError(f"{out!r} holds a manifest of format {old.get('format')!r}, not {prepared.FORMAT}")
    if old["tokenizer"]["identity"] != new["tokenizer"]["identity"]:
        raise ValueError(
            f"--out {out!r} was prepared with tokenizer {old['tokenizer']['spec']!r} ({old['tokenizer']['identity']}),"
            f" not --tokenizer {new['tokenizer']['spec']!r} ({new['tokenizer']['identity']}); use another --out"
        )
    written_without = {"validation_split": "tail", "text_field": None}  # what a manifest without these keys holds
    for key in ("source", "text_field", "validation_split", "validation_fraction", "record_tokens", "dtype", "shards"):
        was = old[key] if key in old else written_without[key]
        if was != new[key]:
            what = "inputs (files, sizes or mtimes)" if key == "shards" else f"{key} ({was!r} vs {new[key]!r})"
            raise ValueError(f"--out {out!r} was prepared with other {what}; use another --out or delete it")


LOCK = "prepare.lock"  # held (flock) by the one prepare writing into a directory; removed when it ends
_WRITTEN = (prepared.MANIFEST, prepared.TOTAL_COUNTS, prepared.counts_file(0), LOCK) + tuple(
    prepared.shard_file(s, 0) for s in documents.SPLITS
)  # the names prepare writes into --out (shard 0 for each shard)


def check_apart(out: str, files: list[str], input: str) -> None:
    """ValueError (one line) when ``out`` is an input file's directory, contains one, or lies inside one where the
    ``input`` glob would match what prepare writes (resolved paths: symlinks followed). Before anything is
    written."""
    real = os.path.realpath(out)
    apart = "give a directory apart from the input"
    for d in sorted({os.path.realpath(os.path.dirname(f)) for f in files}):
        if d == real:
            raise ValueError(f"--out {out!r} is the directory of --input files ({d}); {apart}")
        if d.startswith(real.rstrip(os.sep) + os.sep):
            raise ValueError(f"--out {out!r} contains the directory of --input files {d}; {apart}")
    for name in _WRITTEN:
        if corpus.glob_matches(input, os.path.join(real, name)):
            raise ValueError(
                f"--out {out!r} lies where --input {input!r} reads: it would match the {name} prepare writes there; "
                "give an --out outside the input"
            )


class OutLock:
    """Exclusive lock (``fcntl.flock``) on ``<out>/prepare.lock`` for one prepare; the file names the holder (host,
    pid, start time). A second prepare into the same directory fails at once with a one-line ValueError naming the
    directory and the holder. The file is removed when the holder ends (after a crash the next prepare takes it
    over: the OS drops the lock with its process)."""

    def __init__(self, out: str):
        self.out, self.path = out, os.path.join(out, LOCK)
        self._fd: int | None = None

    def __enter__(self) -> OutLock:
        while True:
            try:
                fd = filelock.lock(self.path)
            except filelock.HeldError as e:
                raise ValueError(
                    f"--out {self.out!r} is in use by another prepare ({e}); wait for it to finish or choose "
                    "another --out"
                ) from None
            except OSError as e:  # cannot create it, or a file system without flock
                raise ValueError(f"--out {self.out!r}: cannot lock {LOCK}: {e.strerror}") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            filelock.unlock(fd)  # the holder removed this file as it ended: lock the one at the path now
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            try:
                os.remove(self.path)  # while still holding it: a waiter that opened it locks the new file instead
            except FileNotFoundError:
                pass
            filelock.unlock(self._fd)
            self._fd = None
