"""What a run tells, for tests that compare runs: the losses of its metrics.jsonl and the arrays of a checkpoint's
train state, keyed so that two runs compare entry by entry (bitwise where a test asks for it), and the messages
the trainer logs in this process."""

import contextlib
import logging
from pathlib import Path

import numpy as np

from lpt.train import metrics


def losses(jsonl) -> tuple[dict, dict]:
    """(train loss by step, eval loss by step) of a metrics.jsonl (a path, or a ``gs://`` URL inside the fake of
    test_object_storage); each step must appear once (a resume drops the steps it re-runs)."""
    train, evals = {}, {}
    for r in metrics.read_jsonl(jsonl):
        for key, out in (("loss", train), ("eval_loss", evals)):
            if key in r:
                assert r["step"] not in out, f"step {r['step']} logged twice in {jsonl}"
                out[r["step"]] = r[key]
    return train, evals


def flat(tree, prefix: str = "") -> dict[str, np.ndarray]:
    """``{"a/b/0": array}`` of the nested dicts, lists and tuples of ``tree`` (None: an empty optimizer-state field)."""
    out = {}
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {} if tree is None else {prefix: np.asarray(tree)}
    for k, v in items:
        out.update(flat(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def state_arrays(workdir, step: int, part: str = "params") -> dict[str, np.ndarray]:
    """The arrays of ``part`` ("params", "opt_state") of checkpoint ``step`` of a local run, as orbax stored them."""
    import orbax.checkpoint as ocp

    state = ocp.StandardCheckpointer().restore(Path(workdir).resolve() / "checkpoints" / str(step) / "state")
    return flat(state[part])


@contextlib.contextmanager
def trainer_log():
    """Within it, the messages the trainer logs in this process (``lpt.train``, INFO and up) are appended to the
    list it gives. Its own handler: pytest's ``caplog`` misses a logger that the first in-process run makes
    non-propagating (:func:`lpt.train.console.setup`), and another test may have raised the logger's level."""
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    log = logging.getLogger("lpt.train")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
