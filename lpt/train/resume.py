"""Resuming with other Adam moment storage: the checkpoint's moments re-stored into ``precision.moment_dtype``.

``precision.moment_dtype`` is the one recipe key a run may change on resume (``config.RESUME_CONVERTED``):
a run started with bf16 (or f32) moments continues with 8-bit ones (6 instead of 8 bytes per parameter with Kahan
weights), or the other way. The trainer

1. builds the train-state layout the checkpoint was written with (:func:`layout_of`: the run's config with the
   checkpoint's ``moment_dtype``, so the stored arrays' shapes and dtypes match and orbax reads them onto the mesh),
2. restores it, checksums verified as always, and
3. re-stores the moments with :func:`lpt.optim.convert_moments` in one jitted function whose outputs have the run's
   shardings (:func:`convert`): going wider is exact, going narrower rounds each moment once to nearest, as a
   step would. Params, the Kahan compensation, the step and everything else pass through bit for bit.

Every later checkpoint holds the new storage; the first one after the conversion records it in its config.
"""

from __future__ import annotations

import logging

import jax
from jax.sharding import Mesh

import lpt.optim as O
from lpt.models import Precision
from lpt.train import config as config_lib
from lpt.train import optimizer
from lpt.train import state as state_lib

log = logging.getLogger("lpt.train")


def _stored_moments(precision: Precision) -> str:
    """The concrete name of the moments' storage of ``precision``: its ``moment_dtype``, with "auto" resolved to the
    params' dtype (lpt's AdamW keeps moments there)."""
    return precision.param_dtype if precision.moment_dtype == "auto" else precision.moment_dtype


def layout_of(cfg: config_lib.Config, mesh: Mesh, current: state_lib.TrainState, model_def):
    """A function ``saved config (dict or None) -> abstract TrainState with shardings`` for
    :meth:`lpt.train.checkpoint.Checkpointer.restore_latest`: ``current`` (the run's own layout) unless the saved
    config stores its moments otherwise, else that storage's layout on ``mesh``."""
    mine = _stored_moments(cfg.precision)

    def layout(saved: dict | None) -> state_lib.TrainState:
        theirs = config_lib.build(saved).precision if saved else None
        if theirs is None or _stored_moments(theirs) == mine:
            return current
        old = config_lib.with_values(cfg, {"precision.moment_dtype": theirs.moment_dtype})
        tx = optimizer.make_optimizer(old, mesh.size, state_lib.param_shardings(model_def, mesh))
        abstract = state_lib.abstract_state(old, tx)
        return state_lib.with_shardings(abstract, state_lib.state_shardings(abstract, model_def, mesh))

    return layout


def convert(state: state_lib.TrainState, saved: dict | None, cfg: config_lib.Config, shardings: state_lib.TrainState):
    """``state`` restored with ``saved``'s moment storage (a checkpoint's config dict), re-stored into ``cfg``'s with
    ``shardings`` (unchanged when the two are the same)."""
    dst = _stored_moments(cfg.precision)
    src = _stored_moments(config_lib.build(saved).precision) if saved else dst
    if src == dst:
        return state
    log.info("re-storing Adam's moments from %s (the checkpoint's) into %s (precision.moment_dtype)", src, dst)
    to_new = jax.jit(lambda opt: O.convert_moments(opt, src, dst), out_shardings=shardings.opt_state)
    return state.replace(opt_state=to_new(state.opt_state))
