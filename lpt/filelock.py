"""An exclusive lock on a local file that names its holder: one writer per directory for lpt's commands.

``fd = lock(path)`` opens ``path`` (created if missing), takes an exclusive ``fcntl.flock`` without waiting and writes
the holder into it (``{"host", "pid", "started"}``, :func:`holder`); ``unlock(fd)`` gives it up. When another
process holds it, :class:`HeldError` says who (:func:`describe`); the OS drops a lock when its holder exits or
crashes, so a lock file left behind never blocks a later process. The trainer's workdir lock
(:mod:`lpt.train.workdir`) and ``lpt.data.prepare``'s output lock are built on it; each words its own errors.
Imports nothing of lpt.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket


class HeldError(Exception):
    """Another process holds the lock; ``str(e)`` describes the holder (host, pid, start time)."""


def holder() -> dict:
    """This process as a holder: host name, pid and start time (local time with its offset)."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def describe(h: dict) -> str:
    """``host H, pid P, started T`` of a holder dict."""
    return f"host {h.get('host')}, pid {h.get('pid')}, started {h.get('started')}"


def lock(path) -> int:
    """The descriptor of ``path`` (created, mode 0644, if missing), locked exclusively, with :func:`holder` written
    into it. HeldError when another process holds it; OSError when it cannot be created or locked (a file system
    without ``flock``)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held = HeldError(_read(fd))
        os.close(fd)
        raise held from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder()).encode(), 0)
    return fd


def unlock(fd: int) -> None:
    """Release and close a descriptor from :func:`lock`."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _read(fd: int) -> str:
    try:
        h = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return describe(h) if isinstance(h, dict) and {"host", "pid", "started"} <= h.keys() else "holder unknown"
    except (ValueError, OSError):
        return "holder unknown"
