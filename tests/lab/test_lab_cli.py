"""Bad input to ``python -m lpt.lab``: one ``error:`` line naming the key or the section, exit code 2, and ``--out`` not
created (every config a recipe section runs is built before anything is written; nothing is trained here)."""

import pytest

from lpt.lab.__main__ import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["recipes", "--set", "train.stpes=3"],
            "error: --set train.stpes=3: unknown config key 'train.stpes'; did you mean 'train.steps'?",
        ),
        (["cost", "--quick", "--set", "optim.lr=nan"], "config key optim.lr=nan must be finite and > 0"),
        (["recipes", "--set", "model.d_ff=200", "--recipes", "nvfp4"], "precision.matmul.up='nvfp4' needs K and N"),
        (["finetune", "--set", "train.seed=1"], "--set and --recipes apply to the recipes and cost sections only"),
        (["recipes", "--recipes", "bf16_kahn"], "--recipes: 'bf16_kahn' is not a recipe; available: fp32"),
    ],
    ids=["unknown_key", "nan", "recipe_misfit", "unused_set", "unknown_recipe"],
)
def test_bad_lab_input_is_one_error_line_and_writes_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "lab"
    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not out.exists()
