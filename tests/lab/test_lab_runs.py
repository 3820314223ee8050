"""lpt.lab.runs.trained on a run the trainer stopped early (SIGTERM, Ctrl-C): one error line that says how to resume,
not a KeyError from a summary that has no loss."""

import pytest

from lpt.lab import runs


def test_a_preempted_run_is_one_error_that_says_how_to_resume(monkeypatch, tmp_path):
    monkeypatch.setattr(runs.loop, "train", lambda cfg, run_dir: {"preempted_at": 24})
    with pytest.raises(SystemExit) as e:
        runs.trained(None, tmp_path / "f32")
    msg = str(e.value)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    assert "step 24" in msg and str(tmp_path / "f32") in msg and "again to resume" in msg, msg
