"""The run's working directory: checked before anything is written, and locked for the run's lifetime.

``WorkdirLock(workdir)`` makes sure the directory exists and is writable (a one-line ``ValueError`` otherwise: a path
that is a file, one that cannot be created or written), then takes an exclusive OS lock (``fcntl.flock``) on
``<workdir>/lpt.lock`` and writes the holder (host, pid, start time) into it. A second trainer on the same workdir
fails at once with a ``ValueError`` naming the holder. The OS drops the lock when the holder exits or crashes, so a
stale lock file never blocks a later run. On a multi-process run, process 0 holds the lock.

A run that fails before it writes anything (a config that does not compile, bad data) removes the directories it
created (:func:`first_missing`, :func:`remove_if_unused`), so a typo leaves no new workdir behind.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import shutil
import socket
from pathlib import Path

LOCK_NAME = "lpt.lock"


def prepare(workdir: str | Path) -> Path:
    """Create ``workdir`` if needed; ValueError (one line) if it is empty (an unset shell variable would train into
    the current directory), a file, cannot be created or is not writable."""
    path = _nonempty(workdir)
    if _exists(path) and not path.is_dir():
        raise ValueError(f"--workdir {str(path)!r} is a file; give a directory (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--workdir {str(path)!r} cannot be created: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--workdir {str(path)!r} is not writable")
    return path


def first_missing(workdir: str | Path) -> Path | None:
    """The outermost directory of ``workdir``'s path that does not exist yet (what :func:`prepare` would create),
    or None if ``workdir`` exists."""
    path = Path(workdir).absolute()
    if not str(workdir).strip() or _exists(path):
        return None
    while not _exists(path.parent):
        path = path.parent
    return path


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name the file system cannot hold (over 255 bytes): it does not exist
        return False


def remove_if_unused(directory: Path) -> None:
    """Remove ``directory`` (one a failed run created) if it holds no file but the lock: nothing a user could
    want."""
    if not _exists(directory) or not directory.is_dir():
        return
    for _, _, files in os.walk(directory):
        if any(f != LOCK_NAME for f in files):
            return
    shutil.rmtree(directory, ignore_errors=True)


def _nonempty(workdir: str | Path) -> Path:
    if not str(workdir).strip():
        raise ValueError(f"--workdir {str(workdir)!r} is empty; give the run's directory (it is created if missing)")
    return Path(workdir)


class WorkdirLock:
    """Exclusive lock on ``<workdir>/lpt.lock``; use as a context manager (``enabled=False``: a no-op)."""

    def __init__(self, workdir: str | Path, *, enabled: bool = True):
        self.path = _nonempty(workdir) / LOCK_NAME
        self.enabled = enabled
        self._fd: int | None = None

    def __enter__(self) -> WorkdirLock:
        if not self.enabled:
            return self
        prepare(self.path.parent)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ValueError(f"--workdir {str(self.path.parent)!r}: cannot create {LOCK_NAME}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ValueError(
                f"--workdir {str(self.path.parent)!r} is in use by another trainer ({holder}); wait for it to finish "
                f"or choose another --workdir"
            ) from None
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        h = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {h['host']}, pid {h['pid']}, started {h['started']}"
    except (ValueError, KeyError, OSError):
        return "holder unknown"
