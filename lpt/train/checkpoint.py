"""Checkpoints with orbax ``CheckpointManager``: train state + grain iterator state + JSON metadata.

Layout: ``<workdir>/checkpoints/<step>/{state, data, metadata}``. ``state`` is the train state as a pytree of
(sharded) arrays, ``data`` the grain iterator's JSON state (one file per process, so a restore needs the same process
count), ``metadata`` a JSON dict (step, config, library versions, mesh, process count, data worker count).

* Saves are asynchronous (orbax writes in a background thread after copying device arrays); ``wait()`` blocks.
* ``keep_checkpoints`` newest steps are kept, older ones deleted.
* ``restore_latest`` tries the newest step first; if it cannot be read (a crash mid-write that orbax did not catch,
  a truncated or deleted file), it warns and falls back to the previous step, and so on.
* Restoring takes an abstract state whose ``ShapeDtypeStruct`` leaves carry the *current* mesh's shardings, so a
  checkpoint written on one mesh restores onto another (orbax reshards on read).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import grain.checkpoint
import orbax.checkpoint as ocp

from lpt.train.state import TrainState

log = logging.getLogger("lpt.train")


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` for the trainer's three items."""

    def __init__(self, workdir: str | Path, *, keep: int, async_save: bool = True):
        self.directory = Path(workdir).resolve() / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save, cleanup_tmp_directories=True
        )
        self.manager = ocp.CheckpointManager(self.directory, item_names=("state", "data", "metadata"), options=options)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: TrainState, data_iter, metadata: dict, *, force: bool = False) -> bool:
        """Start saving ``state`` (and the iterator position, and metadata) as ``step``; returns immediately."""
        items = {"state": ocp.args.StandardSave(state.to_dict()), "metadata": ocp.args.JsonSave(metadata)}
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iter)
        return self.manager.save(step, args=ocp.args.Composite(**items), force=force)

    def restore_latest(self, abstract: TrainState, data_iter) -> tuple[TrainState, dict] | None:
        """Restore the newest readable checkpoint onto ``abstract``'s shardings (None if there is none).

        Raises ValueError if checkpoints exist but none can be restored (typically a changed model config).
        """
        errors = []
        for step in reversed(self.steps()):
            try:
                return self.restore(step, abstract, data_iter)
            except Exception as e:  # noqa: BLE001 -- any read failure means "this checkpoint is unusable"
                errors.append(f"step {step}: {type(e).__name__}: {str(e)[:300]}")
                msg = f"checkpoint {errors[-1]} could not be restored; falling back to the previous checkpoint"
                warnings.warn(msg, stacklevel=2)
                log.warning(msg)
        if errors:
            raise ValueError(
                f"{self.directory} holds checkpoints {self.steps()} but none can be restored with the current config "
                f"(did the model, precision or process count change?). Use a new --workdir. Errors: {errors}"
            )
        return None

    def restore(self, step: int, abstract: TrainState, data_iter) -> tuple[TrainState, dict]:
        items: dict[str, Any] = {
            "state": ocp.args.StandardRestore(abstract.to_dict()),
            "metadata": ocp.args.JsonRestore(),
        }
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        return TrainState.from_dict(restored["state"]), dict(restored["metadata"])

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
