"""What the trainer prints on stderr: lpt's log lines, and the libraries' failure reports one line each.

:func:`setup` (called by ``python -m lpt.train``, ``lpt.generate``, ``lpt.eval`` and ``lpt.export``) starts jax on the
CPU alone on a machine without accelerators (:func:`_cpu_unless_accelerator`), gives the ``lpt`` logger its handler
(``time LEVEL message``), and
trims what orbax reports through absl's logger from its background threads (a failed save: the error, then its
traceback, then a spec dump) to the message's first line: the trainer itself then raises one error line for the
failure. It also silences the exceptions that orbax's abandoned read coroutines raise when they are garbage
collected after a failed restore ("Exception ignored in: <coroutine ...>", one traceback per array), and the
"Event loop is closed" error of a TensorStore callback that reports to the loop of a failed read or save: the trainer
has already reported that failure in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

import jax

from lpt import startup

_TENSORSTORE_SPEC = " See full TensorStore details"


def one_line(text: str, limit: int = 300) -> str:
    """The first line of ``text`` without a TensorStore spec dump, at most ``limit`` characters."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first.split(_TENSORSTORE_SPEC)[0][:limit]


class _Stderr(logging.StreamHandler):
    """A handler that writes to ``sys.stderr`` as it is when a record is emitted (not when the handler was made),
    so that a caller that redirects stderr later (a test, a notebook) still gets the lines."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


class _OneLine(logging.Filter):
    """Keeps a record, reduced to the first line of its message (no traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info or record.exc_text or "\n" in str(record.msg):
            record.msg, record.args = one_line(record.getMessage()), ()
            record.exc_info = record.exc_text = record.stack_info = None
        return True


class _Without(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


@contextlib.contextmanager
def without(*starts: str, logger: str = "absl"):
    """Within this context, ``logger`` drops the records whose message starts with one of ``starts`` (a library's
    note about what the caller asked for on purpose, e.g. orbax's on opening a checkpoint read-only)."""
    drop = _Without(starts)
    log = logging.getLogger(logger)
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def _abandoned_read(unraisable) -> bool:
    """An orbax coroutine that raised while being closed (its ``except BaseException`` turns the GeneratorExit of
    garbage collection into an error of its own)."""
    code = getattr(unraisable.object, "cr_code", None)
    cause = getattr(unraisable.exc_value, "__cause__", None)
    return (
        code is not None and "orbax" in code.co_filename and isinstance(cause, GeneratorExit | asyncio.CancelledError)
    )


def _closed_loop(exc: BaseException) -> bool:
    """The RuntimeError a TensorStore callback gets when it reports a finished read to the event loop of a restore
    that already failed and closed it (printed through ``sys.excepthook``)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename if tb is not None else ""
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and "asyncio" in where


def _quiet_unraisable(previous):
    def hook(unraisable):
        if not _abandoned_read(unraisable):
            previous(unraisable)

    hook.lpt_quiet = True
    return hook


def _quiet_excepthook(previous):
    def hook(kind, exc, tb):
        if not _closed_loop(exc):
            previous(kind, exc, tb)

    hook.lpt_quiet = True
    return hook


ACCELERATOR_DEVICES = startup.ACCELERATOR_DEVICES


def _cpu_unless_accelerator() -> bool:
    """Start jax on the CPU alone when :func:`lpt.startup.cpu_only` says so (no accelerator device node,
    ``JAX_PLATFORMS`` unset): jax would otherwise try each installed plugin (CUDA, libtpu) and print their failed
    start-ups (tracebacks and libtpu's host probing, ~30 lines on stderr). Call before jax starts a backend; True if
    it chose the CPU."""
    if jax.config.jax_platforms or not startup.cpu_only():
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


def setup() -> None:
    """Pick the CPU on a machine without accelerators (:func:`_cpu_unless_accelerator`), install the ``lpt`` log
    handler and the one-line filters (idempotent)."""
    _cpu_unless_accelerator()
    root = logging.getLogger("lpt")  # lpt.train, lpt.data, ...
    if not root.handlers:  # our own handler: libraries may already have configured the root logger
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _OneLine) for f in absl.filters):
        absl.addFilter(_OneLine())
    if not getattr(sys.unraisablehook, "lpt_quiet", False):
        sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)
    if not getattr(sys.excepthook, "lpt_quiet", False):
        sys.excepthook = _quiet_excepthook(sys.excepthook)
