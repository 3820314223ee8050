"""The run's working directory: checked before anything is written, and locked for the run's lifetime.

``WorkdirLock(workdir)`` makes sure the directory exists and is writable (a one-line ``ValueError`` otherwise: a path
that is a file, one that cannot be created or written), then takes the workdir for this trainer; a second trainer on
the same workdir fails at once with a ``ValueError`` naming the holder. On a multi-process run, process 0 holds it.

* A local workdir (a mounted bucket included): an exclusive OS lock (``fcntl.flock``) on ``<workdir>/lpt.lock``,
  whose content names the holder (host, pid, start time). The OS drops the lock when the holder exits or crashes, so
  a stale lock file never blocks a later run.
* An object-storage workdir (``gs://``, :mod:`lpt.train.paths`) has no ``flock``; ``lpt.lock`` is a *lease*
  (:class:`Lease`): a JSON object naming the holder and a heartbeat time, written only with TensorStore's
  conditional writes (GCS: ``ifGenerationMatch``), so of two trainers that start together exactly one creates it.
  The holder rewrites it every :data:`HEARTBEAT_SECONDS` (a background thread) and before every checkpoint, each
  time on the condition that it is still the object the holder wrote last; it deletes it, on the same condition,
  when the run ends. A lease whose heartbeat is older than :data:`LEASE_SECONDS` (by the new trainer's clock), or
  whose holder runs on this host under a pid that no longer exists, is stale: a new trainer takes it over, with one
  warning naming the old holder. A holder that finds its lease taken over stops before its next checkpoint with a
  ValueError (it writes no checkpoint over the new holder's).

A run that fails before it writes anything (a config that does not compile, bad data) removes the directories it
created (:func:`first_missing`, :func:`remove_if_unused`), so a typo leaves no new workdir behind. It removes them
while it still holds the lock, and never a directory that holds any file but its own lock: a trainer that lost the
race for a new workdir (another one created it first, or in the same instant) removes nothing, and neither does a
failed run whose new parent directory meanwhile holds another trainer's workdir.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from pathlib import Path

from lpt import filelock
from lpt.train import paths

log = logging.getLogger("lpt.train")

_LOCK_NAME = "lpt.lock"
LEASE_SECONDS = 300.0  # an object-storage lease whose heartbeat is older is stale: a new trainer takes it over
HEARTBEAT_SECONDS = 30.0  # how often the holder rewrites its lease's heartbeat


def prepare(workdir: str | Path) -> Path:
    """Create ``workdir`` if needed; ValueError (one line) if it is empty (an unset shell variable would train into
    the current directory), a file, cannot be created or is not writable."""
    path = _nonempty(workdir)
    if _exists(path) and not path.is_dir():
        raise ValueError(f"--workdir {str(path)!r} is a file; give a directory (it is created if missing)")
    if not paths.is_remote(path) and _is_symlink(path) and not _exists(path):
        raise ValueError(
            f"--workdir {str(path)!r} is a symlink to {os.readlink(path)!r}, which does not exist; create that "
            f"directory or give another --workdir"
        )
    if paths.is_remote(path):  # object storage: no directory to create; the lease's write checks the access
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--workdir {str(path)!r} cannot be created: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--workdir {str(path)!r} is not writable")
    return path


def first_missing(workdir: str | Path) -> Path | None:
    """The outermost directory of ``workdir``'s path that does not exist yet (what :func:`prepare` would create),
    or None if ``workdir`` exists. For object storage: ``workdir`` itself when nothing is stored under it."""
    if not str(workdir).strip():
        return None
    if paths.is_remote(workdir):
        path = paths.run_path(workdir)
        return None if _exists(path) else path
    path = Path(workdir).absolute()
    if _exists(path):
        return None
    while not _exists(path.parent):
        path = path.parent
    return path


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name the file system cannot hold (over 255 bytes): it does not exist
        return False


def _is_symlink(path: Path) -> bool:
    try:
        return path.is_symlink()
    except OSError:  # a name the file system cannot hold
        return False


def remove_if_unused(directory: Path, own_lock: Path | None = None) -> None:
    """Remove ``directory`` (one a failed run created) if the only file under it is ``own_lock``, the lock of the
    trainer that calls this (and still holds it): nothing a user could want. Any other file, another trainer's lock
    included (held now, or left by a run that held it), keeps the directory."""
    if not _exists(directory) or not directory.is_dir():
        return
    remote = paths.is_remote(directory)
    own = None if own_lock is None else str(own_lock if remote else Path(own_lock).absolute())
    for root, _, files in directory.walk() if remote else os.walk(directory):
        base = root if remote else Path(root).absolute()
        if any(str(base / f) != own for f in files):
            return
    if remote:
        try:
            directory.rmtree()
        except OSError:  # empty prefixes that the store already dropped
            pass
    else:
        shutil.rmtree(directory, ignore_errors=True)


def _nonempty(workdir: str | Path) -> Path:
    if not str(workdir).strip():
        raise ValueError(f"--workdir {str(workdir)!r} is empty; give the run's directory (it is created if missing)")
    return paths.run_path(workdir)


class WorkdirLock:
    """Exclusive lock on ``<workdir>/lpt.lock`` (``flock``, or a :class:`Lease` on object storage); use as a context
    manager (``enabled=False``: a no-op).

    With ``cleanup=True``, the directories that taking the lock created (:func:`first_missing`) are removed again
    when the ``with`` block raises, before the lock is released, if they hold nothing but this lock
    (:func:`remove_if_unused`); a lock that could not be taken because another trainer holds it removes nothing."""

    def __init__(self, workdir: str | Path, *, enabled: bool = True, cleanup: bool = False):
        self.path = _nonempty(workdir) / _LOCK_NAME
        self.enabled = enabled
        self.cleanup = cleanup
        self._created: Path | None = None
        self._fd: int | None = None
        self._lease: Lease | None = None

    def refresh(self) -> None:
        """Before a checkpoint: renew the lease (ValueError if another trainer took it over); a no-op for ``flock``,
        which the OS holds."""
        if self._lease is not None:
            self._lease.refresh()

    def __enter__(self) -> WorkdirLock:
        if not self.enabled:
            return self
        created = first_missing(self.path.parent) if self.cleanup else None
        try:
            self._acquire()
        except _InUseError:
            raise  # the directory is the holder's, whoever created it
        except BaseException:
            if created is not None:
                remove_if_unused(created)
            raise
        self._created = created
        return self

    def _acquire(self) -> None:
        prepare(self.path.parent)
        if paths.is_remote(self.path):
            self._lease = Lease(self.path.parent).acquire()
            return
        try:
            self._fd = filelock.lock(self.path)
        except filelock.HeldError as e:
            raise _InUseError(
                f"--workdir {str(self.path.parent)!r} is in use by another trainer ({e}); wait for it to finish "
                f"or choose another --workdir"
            ) from None
        except OSError as e:
            raise ValueError(f"--workdir {str(self.path.parent)!r}: cannot lock {_LOCK_NAME}: {e.strerror}") from None

    def __exit__(self, exc_type, *exc) -> None:
        try:
            if exc_type is not None and self._created is not None:
                remove_if_unused(self._created, own_lock=self.path)  # still held: no other trainer is in it
        finally:
            self._created = None
            self._release()

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._fd is not None:
            filelock.unlock(self._fd)
            self._fd = None


class _InUseError(ValueError):
    """The workdir is held by another trainer (its lock or a fresh lease)."""


def _pid_gone(holder: dict) -> bool:
    """True if ``holder`` ran on this host under a pid that no longer exists (it died: its lease is stale)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    return not pid_alive(holder["pid"])


def pid_alive(pid: int) -> bool:
    """True if a process ``pid`` exists on this machine (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists (another user's process)
        return True
    return True


class Lease:
    """``<workdir>/lpt.lock`` on object storage: who holds the workdir, renewed by its holder (module docstring).

    Every write is conditional on the object's generation: creating needs "no object", renewing and deleting need
    the generation this holder wrote last. What that guarantees: two trainers never both hold a fresh lease; a
    holder learns that it lost the lease at its next renewal at the latest, and stops before its next checkpoint.
    What it does not: a holder that stops renewing for :data:`LEASE_SECONDS` while still running (a process paused
    that long, or cut off from the store) loses the lease to a new trainer and may still write metrics until its next
    renewal; a stale lease is judged by the new trainer's clock against the holder's, so the hosts' clocks must
    agree to well within :data:`LEASE_SECONDS`. Checkpoint steps are orbax's: each complete step carries its commit
    file, written last, so a step that a stopped holder left half-written is never restored.
    """

    def __init__(self, workdir):
        self.workdir = workdir
        self._kv = None
        self._generation: bytes | None = None
        self._record: dict = {}
        self._lost: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _store(self):
        if self._kv is None:
            import tensorstore as ts

            try:
                self._kv = ts.KvStore.open(paths.kvstore_spec(self.workdir)).result()
            except Exception as e:  # noqa: BLE001 -- tensorstore reports a bad spec or credentials as several types
                raise ValueError(
                    f"--workdir {str(self.workdir)!r}: cannot open it for {_LOCK_NAME}: {_one_line(e)}"
                ) from None
        return self._kv

    def _read(self):
        try:
            return self._store().read(_LOCK_NAME).result()
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"--workdir {str(self.workdir)!r}: cannot read {_LOCK_NAME}: {_one_line(e)}") from None

    def _write(self, record: dict | None, if_equal: bytes) -> bytes:
        """Write (None: delete) the lease if its generation is ``if_equal``; the new generation, b"" if it was not."""
        value = None if record is None else json.dumps(record).encode()
        return self._store().write(_LOCK_NAME, value, if_equal=if_equal).result().generation

    def acquire(self) -> Lease:
        """Create the lease, or take over a stale one; ValueError naming the holder of a fresh one."""
        for _ in range(3):  # a lost race re-reads what the winner wrote
            found = self._read()
            if found.state == "value":
                holder = _parse(found.value)
                age = time.time() - holder.get("heartbeat", 0.0) if holder else float("inf")
                if holder and age < LEASE_SECONDS and not _pid_gone(holder):
                    raise _InUseError(
                        f"--workdir {str(self.workdir)!r} is in use by another trainer ({filelock.describe(holder)}, "
                        f"last heartbeat {age:.0f} s ago); wait for it to finish or choose another --workdir (a "
                        f"lease not renewed for {LEASE_SECONDS:.0f} s is taken over)"
                    )
                log.warning(
                    "--workdir %s: taking over the stale lease of %s (%s)",
                    self.workdir,
                    filelock.describe(holder) if holder else "an unreadable holder",
                    f"last heartbeat {age:.0f} s ago" if age != float("inf") else "no heartbeat",
                )
            record = {**filelock.holder(), "token": secrets.token_hex(8), "heartbeat": time.time()}
            try:
                generation = self._write(record, found.stamp.generation)
            except Exception as e:  # noqa: BLE001 -- permissions, a missing bucket
                raise ValueError(
                    f"--workdir {str(self.workdir)!r}: cannot write {_LOCK_NAME}: {_one_line(e)}"
                ) from None
            if generation:
                self._generation, self._record = generation, record
                self._thread = threading.Thread(target=self._beat, name="lpt-lease", daemon=True)
                self._thread.start()
                return self
        raise _InUseError(
            f"--workdir {str(self.workdir)!r} is being taken by another trainer; choose another --workdir"
        )

    def refresh(self) -> None:
        """Renew the heartbeat now; ValueError if the lease was taken over or deleted (this trainer must stop). A
        renewal that fails (the store unreachable) is one warning: the lease lasts :data:`LEASE_SECONDS`."""
        with self._lock:
            if self._lost is None and self._generation is not None:
                try:
                    self._renew()
                except Exception as e:  # noqa: BLE001 -- tensorstore reports I/O failures as several types
                    log.warning("--workdir %s: could not renew %s (%s)", self.workdir, _LOCK_NAME, _one_line(e))
            if self._lost is not None:
                raise ValueError(self._lost)

    def _renew(self) -> None:
        record = {**self._record, "heartbeat": time.time()}
        generation = self._write(record, self._generation)
        if generation:
            self._generation, self._record = generation, record
            return
        found = self._read()
        holder = _parse(found.value) if found.state == "value" else None
        self._lost = (
            f"--workdir {str(self.workdir)!r}: this trainer's lease was taken over by "
            f"{filelock.describe(holder) if holder else 'nobody (it was deleted)'}; stopping without writing another "
            f"checkpoint"
        )

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            with self._lock:
                if self._lost is not None:
                    return
                try:
                    self._renew()
                except Exception as e:  # noqa: BLE001 -- a failed renewal is retried; the lease lasts LEASE_SECONDS
                    log.warning("--workdir %s: could not renew %s (%s)", self.workdir, _LOCK_NAME, _one_line(e))

    def release(self) -> None:
        """Stop renewing and delete the lease if this trainer still holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._lost is None and self._generation is not None:
                try:
                    self._write(None, self._generation)
                except Exception as e:  # noqa: BLE001 -- the lease then goes stale by itself
                    log.warning("--workdir %s: could not delete %s (%s)", self.workdir, _LOCK_NAME, _one_line(e))
            self._generation = None


def _parse(value: bytes) -> dict | None:
    try:
        holder = json.loads(value.decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return holder if isinstance(holder, dict) and isinstance(holder.get("heartbeat"), int | float) else None


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__.lstrip('_')}: {text[:200]}"
