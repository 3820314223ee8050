"""tests/slow_tests.txt, the slow tier (tests/conftest.py marks its ids ``slow``): every line names a test function
that its file defines, with the seconds that put it there (5 or more), once; and, in a session that collected the
whole suite (the README's command, ``-m slow``, a plain ``pytest``), every id is a test that session collected, so a
renamed or removed test cannot drop out of the list unnoticed."""

import re
from pathlib import Path

import pytest
from slow_tier import COLLECTED, entries

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


def test_every_entry_is_a_test_this_session_collected(request):
    config = request.config
    if [Path(config.invocation_params.dir, a).resolve() for a in config.args] != [TESTS]:
        pytest.skip("this session collected part of the suite")
    collected = config.stash[COLLECTED]
    files = {nodeid.split("::")[0] for nodeid in collected}  # a module skipped at import (no torch) has no tests
    stale = [e for e in entries() if e.split("::")[0] in files and e not in collected]
    assert not stale, f"tests/slow_tests.txt names {len(stale)} test(s) that do not exist: {stale[:3]}"
    assert sum(e.split("::")[0] in files for e in entries()) > 100
