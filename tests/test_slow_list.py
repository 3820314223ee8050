"""tests/slow_tests.txt, the slow tier (tests/conftest.py marks its ids ``slow``): every line names a test function
that its file defines, with the seconds that put it there (5 or more), once. The full check, that each id is a test
the suite collects, runs whenever the whole suite is collected (conftest)."""

import re
from pathlib import Path

TESTS = Path(__file__).parent


def test_every_entry_names_a_test_of_its_file_with_its_seconds():
    entries = [line for line in (TESTS / "slow_tests.txt").read_text("utf-8").splitlines() if line and line[0] != "#"]
    assert len(entries) > 100
    ids = []
    for line in entries:
        m = re.fullmatch(r"(tests/[\w/]+\.py)::(\w+)(\[.*\])?  # (\d+) s", line)
        assert m, line
        path, function, _, seconds = m.groups()
        assert re.search(rf"^def {function}\(", (TESTS.parent / path).read_text("utf-8"), re.M), line
        assert int(seconds) >= 5, line
        ids.append(line.split("  #")[0])
    assert len(ids) == len(set(ids))
