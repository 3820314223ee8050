"""The slow tier's list (tests/slow_tests.txt) and the ids a session collected, shared by tests/conftest.py (which
marks the listed tests ``slow``) and tests/test_slow_list.py (which checks the list)."""

from pathlib import Path

import pytest

LIST = Path(__file__).with_name("slow_tests.txt")
COLLECTED = pytest.StashKey[frozenset]()  # every test id the session collected, before -m / -k deselect any


def entries() -> list[str]:
    """The test ids of the list, in its order (one per line, then ``  # seconds``; ``#`` lines are comments)."""
    lines = LIST.read_text("utf-8").splitlines()
    return [line.split("  #", 1)[0].strip() for line in lines if line.strip() and not line.startswith("#")]
