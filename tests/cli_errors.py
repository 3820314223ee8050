"""What a command-line tool's bad input must print: exactly one ``error: ...`` line on stderr, no traceback."""


def one_error(err: str, *names: str) -> str:
    """The one line of ``err`` (stderr), checked to be ``error: ...`` naming each of ``names``."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]
