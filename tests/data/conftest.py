"""Shared data fixtures: a byte-level BPE trained once per session on the embedded corpus's train split."""

import pytest

from lpt.data import train_tokenizer


@pytest.fixture(scope="session")
def bpe512(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tok") / "bpe512.json")
    train_tokenizer.train_tokenizer(512, path, progress=False)
    return path
