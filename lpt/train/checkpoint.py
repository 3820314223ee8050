"""Checkpoints with orbax ``CheckpointManager``: train state + JSON metadata.

Layout: ``<workdir>/checkpoints/<step>/{state, metadata}``. ``state`` is the train state as a pytree of (sharded)
arrays, ``metadata`` a JSON dict (step, config, library versions, mesh, process count, data worker count). The data
position is not stored: step ``s`` consumed global batches ``0 … s − 1``, so a resumed run's iterator starts at batch
``s`` (:func:`lpt.data.make_train_iterator`'s ``start``), whatever the process count or data worker count now.
(Checkpoints of older lpt versions also hold a ``data`` item, the grain iterator state; it is not read.)

* Saves are asynchronous (orbax writes in a background thread after copying device arrays); ``wait()`` blocks.
* ``keep_checkpoints`` newest steps are kept, older ones deleted.
* Every save records a checksum of every array of the train state in the metadata (:func:`checksums`: two
  position-mixed uint32 sums per leaf, exact and independent of the sharding). A restore recomputes them; a mismatch
  (bytes overwritten on disk, which orbax does not detect) makes the checkpoint unreadable.
* ``restore_latest`` tries the newest step first; if it cannot be read (a crash mid-write that orbax did not catch,
  a truncated, deleted or overwritten file), the step is moved aside to ``<workdir>/checkpoints_damaged/`` (kept,
  reported in one line) and the previous step is tried, and so on; training continues past the damaged step.
* Restoring takes an abstract state whose ``ShapeDtypeStruct`` leaves carry the *current* mesh's shardings, so a
  checkpoint written on one mesh restores onto another (orbax reshards on read).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from lpt import data as data_lib
from lpt.train import config as config_lib
from lpt.train import console, paths
from lpt.train import guard as guard_lib
from lpt.train.state import TrainState

log = logging.getLogger("lpt.train")

_CHECKSUM = "lpt-sum64-v1"  # the algorithm of :func:`checksums`; checkpoints record it beside the values


def _mix32(x: jax.Array) -> jax.Array:
    """A fixed uint32 -> uint32 mixer (xor-shift-multiply); part of the checksum format, never to be changed."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _leaf_sum(x: jax.Array) -> jax.Array:
    """uint32[2]: sums over elements i of mix(w_i + mix(i ^ c)) for two constants c, w_i the element's bits."""
    x = jnp.asarray(x)
    if jnp.iscomplexobj(x):  # complex64 (packed f32 Adam moments, 8-bit moments' scales): its two f32 parts
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    if x.dtype == jnp.bool_:
        words = x.astype(jnp.uint32)  # bool -> 0/1
    else:
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, unsigned)
        if x.dtype.itemsize == 8:  # fold 64-bit words: high ^ low (u64 -> u32)
            bits = (bits >> 32) ^ (bits & jnp.uint64(0xFFFFFFFF))
        words = bits.astype(jnp.uint32)  # exact: the bit pattern, zero-extended
    idx = jax.lax.iota(jnp.uint32, words.size).reshape(words.shape)
    sums = [jnp.sum(_mix32(words + _mix32(idx ^ jnp.uint32(c))), dtype=jnp.uint32) for c in (0x9E3779B9, 0x85EBCA6B)]
    return jnp.stack(sums)  # uint32 addition wraps: exact and the same in any reduction order


_checksum_fn = jax.jit(lambda tree: jax.tree.map(_leaf_sum, tree))


def checksums(tree) -> dict[str, str]:
    """``{leaf path "a/b/c": 16 hex digits}`` of every array in ``tree`` (a pytree of possibly sharded arrays)."""
    sums = jax.device_get(_checksum_fn(tree))
    flat = jax.tree_util.tree_flatten_with_path(sums)[0]
    return {_path_name(path): "".join(f"{int(w):08x}" for w in np.asarray(v)) for path, v in flat}


def _path_name(path) -> str:
    """``opt_state/1/0/mu/blocks/0/...``: the same for a state tree and for orbax's target-free restore of it (which
    gives dicts and lists where the state has named tuples and integer keys)."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return "/".join(parts)


class _DamagedCheckpointError(ValueError):
    """A checkpoint whose arrays do not match the checksums recorded when it was saved."""


def verify(state, metadata: dict) -> bool:
    """True if ``state`` matches the checksums in ``metadata``; False if it has none (saved without them); raises
    _DamagedCheckpointError on a mismatch."""
    if metadata.get("checksum") != _CHECKSUM:
        return False
    saved, got = metadata["checksums"], checksums(state)
    bad = sorted(k for k in saved.keys() | got.keys() if saved.get(k) != got.get(k))
    if bad:
        raise _DamagedCheckpointError(f"{len(bad)} array(s) do not match the checksums saved with them, e.g. {bad[:3]}")
    return True


class AllDamagedError(ValueError):
    """Every checkpoint step of a workdir was unreadable; all were moved aside."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a lost mount): an I/O failure, not bad input."""


def _verified(state: dict, metadata: dict, what: str) -> bool:
    """:func:`verify`, with one warning when the checkpoint has no checksums (saved by an lpt without them)."""
    if verify(state, metadata):
        return True
    log.warning("%s has no checksums (an older lpt saved it): its arrays are restored unverified", what)
    return False


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` for the trainer's three items.

    A save that fails (also in orbax's background thread, reported at the next save, ``wait`` or ``close``) raises
    :class:`CheckpointWriteError` naming the step; the steps saved before it stay complete.
    """

    def __init__(self, workdir: str | Path, *, keep: int, async_save: bool = True):
        self.directory = paths.resolve(workdir) / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save, cleanup_tmp_directories=True
        )
        self.manager = ocp.CheckpointManager(self.directory, item_names=("state", "data", "metadata"), options=options)
        self._saving: int | None = None  # the step whose asynchronous save may still fail

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: TrainState, metadata: dict, *, force: bool = False) -> bool:
        """Start saving ``state`` (and metadata with the state's checksums) as ``step``; returns once the checksums
        are computed and the arrays copied, while the files are written."""
        metadata = {**metadata, "checksum": _CHECKSUM, "checksums": checksums(state.to_dict())}
        metadata["guard"] = guard_lib.to_json(state.guard)
        items = {"state": ocp.args.StandardSave(state.to_dict()), "metadata": ocp.args.JsonSave(metadata)}
        self.wait()  # the previous save's failure is its own (orbax waits for it before a new save anyway)
        with self._writing(step):
            started = self.manager.save(step, args=ocp.args.Composite(**items), force=force)
        self._saving = step
        return started

    @contextlib.contextmanager
    def _writing(self, step: int | None):
        """Turn a failed write of ``step`` (or of the save still in flight) into one CheckpointWriteError line."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 -- orbax and tensorstore report write failures as several types
            failed = self._saving if self._saving is not None else step
            raise CheckpointWriteError(
                f"could not write checkpoint step {failed} in {self.directory} ({_one_line(e)}); the steps saved "
                f"before it are complete: free space or fix the file system, then run again to resume"
            ) from None

    def restore_latest(
        self, abstract: TrainState, config: config_lib.Config | None = None, layout_of=None, corpus: dict | None = None
    ) -> tuple[TrainState, dict] | None:
        """Restore the newest readable checkpoint onto ``abstract``'s shardings (None if there is none).

        ``layout_of`` (saved config dict or None -> abstract TrainState with shardings), when given, names the layout
        a step was written with where it differs from ``abstract`` (:func:`lpt.train.resume.layout_of`: other moment
        storage); the step is restored onto that layout and the caller converts it.

        With ``config`` (the run's), a step saved with another model, precision recipe, seed or data position
        (:func:`lpt.train.config.resume_conflicts`) raises ValueError naming every differing key; nothing is moved.
        With ``corpus`` (:func:`lpt.data.corpus_identity` of the run's data), a step saved on another corpus (files
        added, deleted or changed behind the same ``data.paths``) raises ValueError naming the differences; a step
        saved without one (an older lpt) is not compared.
        A step whose files cannot be read, or whose arrays fail their checksums, is moved aside (:meth:`move_aside`)
        and the previous step is tried. A step whose stored arrays do not have the current config's shapes and
        dtypes raises ValueError (a changed model, precision or optimizer: use a new workdir); nothing is moved then.
        If every step was damaged (all moved aside), AllDamagedError (a ValueError) says so: the next run starts from
        step 0.
        """
        moved = []
        for step in reversed(self.steps()):
            metadata = self._saved_metadata(step)
            if metadata is not None and "step" not in metadata:
                raise ValueError(
                    f"checkpoint step {step} in {self.directory} has metadata without lpt's keys (step, config, "
                    f"checksums; it holds {sorted(metadata)}): lpt's trainer did not write it; move it out of "
                    f"checkpoints/ or use a new --workdir"
                )
            saved = metadata.get("config") if config is not None and metadata else None
            conflicts = config_lib.resume_conflicts(saved, config) if isinstance(saved, dict) and saved else []
            if conflicts:
                raise ValueError(
                    f"checkpoint step {step} in {self.directory} was saved with another model, precision recipe, "
                    f"seed or data position ({'; '.join(conflicts)}); a run resumes only with the same ones: use a new "
                    f"--workdir (with --config.init_from.workdir={self.directory.parent} to start from its weights)"
                )
            changes = _corpus_changes(metadata.get("corpus") if metadata else None, corpus)
            if changes:
                raise ValueError(
                    f"checkpoint step {step} in {self.directory} was saved on another corpus behind the same "
                    f"data settings ({'; '.join(changes[:8])}{'; ...' if len(changes) > 8 else ''}); a run resumes "
                    f"only on the data it trained on: restore those files, or use a new --workdir (with "
                    f"--config.init_from.workdir={self.directory.parent} to start from its weights)"
                )
            target = layout_of(saved if isinstance(saved, dict) else None) if layout_of is not None else abstract
            wanted = _layout(target.to_dict())
            try:
                stored = _layout(ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state"))
                if not stored:
                    raise ValueError("its array metadata is empty")
            except Exception as e:  # noqa: BLE001 -- unreadable metadata: a damaged step
                moved.append(self.move_aside(step, e))
                continue
            if stored != wanted:
                raise ValueError(
                    f"checkpoint step {step} in {self.directory} holds {len(stored)} arrays that do not match the "
                    f"{len(wanted)} arrays of the current config (did the model, precision or optimizer change?); "
                    f"use a new --workdir"
                )
            try:
                return self.restore(step, target)
            except Exception as e:  # noqa: BLE001 -- the layout matches, so a read failure is damage
                moved.append(self.move_aside(step, e))
        if moved:
            raise AllDamagedError(
                f"none of the checkpoints in {self.directory} could be read; they were moved to "
                f"{moved[0].parent} (kept). Run again to start from step 0, or move one back by hand"
            )
        return None

    def _saved_metadata(self, step: int) -> dict | None:
        """``step``'s JSON metadata, or None when it cannot be read (the restore then decides); a JSON value that is
        not an object is returned as ``{}``."""
        try:
            saved = json.loads((self.directory / str(step) / "metadata" / "metadata").read_text())
        except (OSError, ValueError):
            return None
        return saved if isinstance(saved, dict) else {}

    def restore(self, step: int, abstract: TrainState) -> tuple[TrainState, dict]:
        """Restore ``step``; raises _DamagedCheckpointError if its arrays do not match their recorded checksums."""
        items = {"state": ocp.args.StandardRestore(abstract.to_dict()), "metadata": ocp.args.JsonRestore()}
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        meta = dict(restored["metadata"])
        meta["verified"] = _verified(restored["state"], meta, f"checkpoint step {step} in {self.directory}")
        guard = guard_lib.from_json(meta.get("guard"))  # fresh statistics for a checkpoint without them
        guard = jax.tree.map(lambda v, a: jax.device_put(v, a.sharding), guard, abstract.guard)
        return TrainState.from_dict(restored["state"], guard), meta

    def move_aside(self, step: int, error: Exception) -> Path:
        """Move the unreadable ``step`` to ``<workdir>/checkpoints_damaged/<step>-<time>`` and say so in one line."""
        target = self.directory.parent / "checkpoints_damaged" / f"{step}-{time.strftime('%Y%m%dT%H%M%S')}"
        if jax.process_index() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            if paths.is_remote(target):  # object storage: a copy of every object, then a delete
                (self.directory / str(step)).rename(target)
            else:
                shutil.move(str(self.directory / str(step)), str(target))
            log.warning("checkpoint step %d is unreadable (%s); moved it to %s", step, _one_line(error), target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"lpt checkpoint {step} moved aside")
        self.manager.reload()
        return target

    def wait(self) -> None:
        with self._writing(None):
            self.manager.wait_until_finished()
        self._saving = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()


def _corpus_changes(saved, current: dict | None) -> list[str]:
    """The differences of a checkpoint's recorded corpus from the run's (:func:`lpt.data.corpus_changes`); none when
    either is missing."""
    if not isinstance(saved, dict) or current is None:
        return []
    return data_lib.corpus_changes(saved, current)


def _layout(tree) -> list[tuple[tuple[int, ...], str]]:
    """The sorted (shape, dtype) of every array of a state tree or of a checkpoint's stored metadata."""
    leaves = jax.tree.leaves(getattr(tree, "tree", tree))
    return sorted((tuple(x.shape), str(np.dtype(x.dtype))) for x in leaves)


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__.lstrip('_')}: {console.one_line(str(e), 200)}"


def steps(workdir: str | Path) -> list[int]:
    """The checkpoint steps of the run ``workdir`` (its ``checkpoints/<step>`` directories; orbax renames a step
    into that name only once it is complete, and on object storage, where a rename is a copy, writes the step's
    ``commit_success.txt`` last: only steps holding it count), sorted; ``[]`` when there are none. Reads only:
    creates nothing."""
    directory = paths.run_path(workdir) / "checkpoints"
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.name.isdigit() and p.is_dir()]
    if paths.is_remote(directory):
        found = [p for p in found if ocp.step.is_path_finalized(p)]
    return sorted(int(p.name) for p in found)


def load_params(workdir: str | Path, step: int | None = None) -> tuple[dict, Any]:
    """The params of a run's checkpoint (the newest if ``step`` is None) as a nested dict of numpy arrays, and the
    run's config (a :class:`lpt.train.config.Config`). The arrays are verified against their saved checksums.

    The config is the one saved with the checkpoint, else the run's ``config.json`` (ValueError when neither
    exists). Its ``model.vocab_size`` is the embedding's row count when it says 0 (the tokenizer's size); a nonzero
    size that disagrees with the embedding is a ValueError."""
    directory = paths.resolve(workdir) / "checkpoints"
    if not directory.is_dir():  # read-only: create nothing (CheckpointManager would make the directory)
        what = "does not exist" if not directory.parent.exists() else "holds no checkpoints/ directory"
        raise ValueError(f"--workdir {str(workdir)!r} {what}; give the directory of an lpt run")
    found = steps(workdir)
    if not found:
        raise ValueError(f"{directory} holds no checkpoint")
    step = found[-1] if step is None else step
    if step not in found:
        raise ValueError(f"step={step} is not a checkpoint in {directory}; available: {found}")
    with console.without("CheckpointManagerOptions.read_only=True", "Given directory is read only"):
        options = ocp.CheckpointManagerOptions(create=False, read_only=True)
        manager = ocp.CheckpointManager(directory, options=options)
    args = ocp.args.Composite(state=ocp.args.StandardRestore(), metadata=ocp.args.JsonRestore())
    restored = manager.restore(step, args=args)
    manager.close()
    meta = dict(restored["metadata"])
    _verified(restored["state"], meta, f"checkpoint step {step} in {directory}")
    params = jax.device_get(restored["state"]["params"])
    return params, run_config(workdir, meta.get("config"), params)


def run_config(workdir: str | Path, saved: dict | None, params: dict):
    """The config of the run ``workdir`` as its checkpoint saved it (``saved``; None or empty: the run's
    ``config.json``), every key present (an older run's config lacks the keys added since: they take their defaults),
    with ``model.vocab_size`` checked against the rows of ``params``' embedding (0: set to them)."""
    if not saved:
        file = paths.run_path(workdir) / "config.json"
        if not file.is_file():
            raise ValueError(f"{workdir}: the checkpoint records no config and there is no {file.name}")
        saved = json.loads(file.read_text())
    try:
        cfg = config_lib.build(saved)
    except ValueError as e:
        raise ValueError(f"{workdir}: the run's saved config: {e}") from None
    if "embed" in params:
        rows = int(np.shape(params["embed"]["embedding"])[0])
        if cfg.model.vocab_size == 0:  # the tokenizer's size: the embedding holds it
            cfg = config_lib.with_values(cfg, {"model.vocab_size": rows})
        elif cfg.model.vocab_size != rows:
            raise ValueError(
                f"{workdir}: config model.vocab_size={cfg.model.vocab_size} but the checkpoint's embedding has "
                f"{rows} rows"
            )
    return cfg
