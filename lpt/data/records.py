"""Files of records, one document per record: JSON Lines and Parquet, streamed, with bad records skipped and reported.

* JSON Lines (``source="jsonl"``): read line by line, through gzip for a ``.gz`` file name and zstd for ``.zst``
  (any case). Each line is one JSON object whose string field ``text_field`` (default ``"text"``) is the document,
  stored as its UTF-8 bytes; a line of whitespace only is no record. The document is named ``path:line`` (1-based).
* Parquet (``source="parquet"``, ``pyarrow``): read in record batches of ``_BATCH_ROWS`` rows of the one column
  ``text_field`` (a string or binary column); the value of each row is the document, named ``path:row R``
  (0-based). A file without that column, or with a column of another type, is an error naming the file and its
  columns (every row would be bad).

A bad record (JSONL: not UTF-8, not valid JSON, not an object, no such field, a field that is not a string or holds
an unpaired surrogate escape; Parquet: a null or a value that is not UTF-8) is never a document: it goes to a
:class:`BadRecords`, which counts it, reports it in one line with its file and line (or row) and raises once the
count passes its limit. Memory stays constant in the file size: one line, or one record batch, at a time.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import zlib
from collections.abc import Callable, Iterator

MAX_BAD_RECORDS = 1000  # the most bad records skipped (each reported); one more stops reading with an error
_KEPT_EXAMPLES = 10  # bad records kept by name in BadRecords.examples (and a prepare manifest)
_BATCH_ROWS = 1024  # Parquet rows read at a time

log = logging.getLogger("lpt.data")


class BadRecords:
    """Counts bad records: ``bad(where, reason)`` reports ``"skipped bad record {where}: {reason}"`` through
    ``report`` (default: a warning on the ``lpt.data`` logger), keeps the first ``_KEPT_EXAMPLES`` in ``examples``
    and raises a one-line ValueError once ``count`` exceeds ``limit``; ``option`` names how the limit is set."""

    def __init__(
        self,
        limit: int = MAX_BAD_RECORDS,
        report: Callable[[str], None] | None = None,
        option: str = "lpt.data.records.MAX_BAD_RECORDS",
    ):
        self.limit, self.option = limit, option
        self.report = report or log.warning
        self.count = 0
        self.examples: list[str] = []

    def __call__(self, where: str, reason: str) -> None:
        self.count += 1
        line = f"{where}: {reason}"
        if len(self.examples) < _KEPT_EXAMPLES:
            self.examples.append(line)
        self.report(f"skipped bad record {line}")
        if self.count > self.limit:
            raise ValueError(
                f"{self.count} bad records, more than {self.option}={self.limit} allows (the last: {line}); "
                "fix the input or raise the limit"
            )


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def _json_type(value) -> str:
    return _JSON_TYPES.get(type(value), "a number")


def _jsonl_document(line: bytes, text_field: str, first: bool = False) -> tuple[bytes | None, str | None]:
    """``(document, None)`` for a good line, ``(None, reason)`` for a bad one, ``(None, None)`` for a blank one.
    ``first``: the file's first line, which may start with a UTF-8 byte order mark."""
    if not line.strip():
        return None, None
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 ({e.reason} at byte {e.start})"
    if first:
        text = text.removeprefix("\ufeff")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at column {e.colno})"
    if not isinstance(obj, dict):
        return None, f"not a JSON object but {_json_type(obj)}"
    if text_field not in obj:
        return None, f"no field {text_field!r}"
    value = obj[text_field]
    if not isinstance(value, str):
        return None, f"field {text_field!r} is {_json_type(value)}, not a string"
    try:
        return value.encode("utf-8"), None
    except UnicodeEncodeError:
        return None, f"field {text_field!r} holds an unpaired surrogate escape (not UTF-8 text)"


def _open_jsonl(path: str):
    """``(binary line iterator, errors the decompressor raises, what the file must be)`` for ``path``, decompressed
    by its suffix."""
    suffix = path.lower().rsplit(".", 1)[-1]
    if suffix == "gz":
        return gzip.open(path, "rb"), (OSError, EOFError, zlib.error), "gzip-compressed JSON Lines (its name ends .gz)"
    if suffix == "zst":
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True, closefd=True)
        expected = "zstd-compressed JSON Lines (its name ends .zst)"
        return io.BufferedReader(reader), (OSError, zstandard.ZstdError), expected
    return open(path, "rb"), (OSError,), "JSON Lines"


def read_jsonl(
    files: list[str], text_field: str = "text", bad: BadRecords | None = None
) -> Iterator[tuple[str, bytes]]:
    """``(path:line, UTF-8 bytes of the text field)`` of every good record of the JSON Lines ``files``, in order. A
    file its decompressor cannot read (a ``.gz`` that is not gzip, corrupt or truncated data) is a one-line
    ValueError naming it and what it must be."""
    bad = bad if bad is not None else BadRecords()
    for path in files:
        fh, errors, expected = _open_jsonl(path)
        lineno = 0
        try:
            with fh:
                for lineno, line in enumerate(fh, 1):
                    doc, reason = _jsonl_document(line, text_field, lineno == 1)
                    if reason is not None:
                        bad(f"{path}:{lineno}", reason)
                    elif doc is not None:
                        yield f"{path}:{lineno}", doc
        except errors as e:
            where = "at its start" if lineno == 0 else f"after line {lineno}"
            raise ValueError(f"cannot read {path!r} as {expected} {where}: {e}") from None


_STRING_TYPES = ("string", "large_string", "string_view", "binary", "large_binary", "binary_view")


def read_parquet(
    files: list[str], text_field: str = "text", bad: BadRecords | None = None
) -> Iterator[tuple[str, bytes]]:
    """``(path:row R, UTF-8 bytes of the column)`` of every good row of the Parquet ``files``, in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = bad if bad is not None else BadRecords()
    for path in files:
        try:
            pf = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise ValueError(f"cannot read {path!r} as a Parquet file: {e}") from e
        schema = pf.schema_arrow
        if text_field not in schema.names:
            raise ValueError(f"{path!r} has no column {text_field!r} to read the text from; columns: {schema.names}")
        kind = str(schema.field(text_field).type)
        if kind not in _STRING_TYPES:
            raise ValueError(f"column {text_field!r} of {path!r} is {kind}; allowed: {list(_STRING_TYPES)}")
        row = 0
        with pf:
            for batch in pf.iter_batches(batch_size=_BATCH_ROWS, columns=[text_field]):
                for value in batch.column(0).cast(pa.large_binary()).to_pylist():  # bytes, checked as UTF-8 below
                    if value is None:
                        bad(f"{path}:row {row}", f"column {text_field!r} is null")
                    else:
                        try:
                            value.decode("utf-8")
                        except UnicodeDecodeError as e:
                            bad(f"{path}:row {row}", f"not UTF-8 ({e.reason} at byte {e.start})")
                        else:
                            yield f"{path}:row {row}", value
                    row += 1
