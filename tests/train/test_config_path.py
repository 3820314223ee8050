"""How far the typed config travels: from ``python -m lpt.train`` to the layers, along the calls that pass the
``Config`` or one of its sections, a run passes through at most 10 lpt modules and never comes back to a module it
left.

The path is recorded with :func:`sys.setprofile` during a real in-process run (the tiny model of
``tests/tiny_run.py``, the program ``test_train_faults`` compiles, so the persistent cache serves it): a call into an
lpt function one of whose arguments is a config section (a dataclass of :mod:`lpt.options`, ``Config`` itself
included), made while ``lpt.train.loop.train`` runs, extends the path of the nearest such call below it on the
stack; consecutive calls within one module are one stop. Building the config (``parse_args``, the sections' checks)
happens before ``train`` and is no stop.
"""

import dataclasses
import sys
from pathlib import Path

from tiny_run import TRAIN_FLAGS

import lpt
from lpt.train.__main__ import main

LPT = str(Path(lpt.__file__).resolve().parent)
MAX_MODULES = 10
ROOT = ("lpt.train.loop", "train")  # where the built config starts its way (python -m lpt.train calls it)


def is_section(typ) -> bool:
    """A config section class: every section (and ``Config``) is a frozen dataclass of :mod:`lpt.options`."""
    return isinstance(typ, type) and dataclasses.is_dataclass(typ)


def _module(frame) -> str:
    return frame.f_globals.get("__name__", "?")


def _carries_config(frame) -> bool:
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    args = frame.f_locals
    return any(is_section(type(args.get(name))) for name in code.co_varnames[:n])


class PathRecorder:
    """``paths``: the module path of every config-carrying lpt call (its nearest config-carrying caller's path, then
    its own module unless that is where the path already is)."""

    def __init__(self):
        self.open = {}  # id(frame) -> path, for the config-carrying frames on the stack
        self.paths = set()

    def __call__(self, frame, event, arg):
        if event == "return":
            self.open.pop(id(frame), None)
            return
        if event != "call" or not frame.f_code.co_filename.startswith(LPT) or not _carries_config(frame):
            return
        caller, below = frame.f_back, ()
        while caller is not None:
            if id(caller) in self.open:
                below = self.open[id(caller)]
                break
            caller = caller.f_back
        here = _module(frame)
        if not below and (here, frame.f_code.co_name) != ROOT:
            return  # building the config (parse_args and the sections' checks) is not a stop on the path
        path = below if below and below[-1] == here else (*below, here)
        self.open[id(frame)] = path
        self.paths.add(path)


def offending(paths, max_modules=MAX_MODULES) -> list[str]:
    """The paths that pass more than ``max_modules`` modules or come back to a module they left."""
    return [" -> ".join(p) for p in sorted(paths) if len(p) > max_modules or len(set(p)) < len(p)]


def test_the_checker_flags_a_long_path_and_a_return():
    assert offending({("a", "b", "a")}) == ["a -> b -> a"]
    assert offending({tuple("abcdefghijk")}, 10) == ["a -> b -> c -> d -> e -> f -> g -> h -> i -> j -> k"]
    assert offending({("a", "b", "c")}) == []

    @dataclasses.dataclass
    class Section:
        x: int = 0

    def takes(cfg):
        return sys._getframe()

    assert _carries_config(takes(Section())) and not _carries_config(takes(3))


def test_the_config_reaches_the_layers_through_at_most_10_modules(tmp_path):
    argv = ["--config", "tiny_cpu", *TRAIN_FLAGS, "--config.train.eval_every=6", "--config.train.steps=6"]
    rec = PathRecorder()
    sys.setprofile(rec)
    try:
        assert main([*argv, "--workdir", str(tmp_path)]) == 0
    finally:
        sys.setprofile(None)
    deepest = max(rec.paths, key=len)  # measured: loop, step, transformer, attention_block, attention.core, ...
    assert any(p[-1].startswith("lpt.models.") for p in rec.paths), sorted(rec.paths)  # it reached the model
    assert not offending(rec.paths), "\n".join(offending(rec.paths))
    assert deepest[0] == "lpt.train.loop", deepest
