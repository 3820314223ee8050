"""``python -m lpt.data.prepare --tokenizer T --input GLOB --out DIR``: tokenize files into ArrayRecord shards.

Input formats (``--source``; left out, it follows the file names: ``.jsonl`` / ``.ndjson``, optionally ``.gz`` or
``.zst``, is jsonl, ``.parquet`` parquet, ``.array_record`` arrayrecord, any other name text; a glob matching files
of two formats is an error). They are the registry :data:`lpt.data.corpus._FILE_SOURCES` the trainer's on-the-fly
path reads (``config.data.source``):

* ``text``: one file = one document (read in pieces).
* ``arrayrecord``: one record = one document (raw bytes).
* ``jsonl``: one line = one document, the string field ``--text-field`` (default ``text``) of its JSON object;
  gzip / zstd files are decompressed as they are read, line by line.
* ``parquet``: one row = one document, the column ``--text-field``, read one record batch at a time.

A bad jsonl / parquet record (not UTF-8, not valid JSON, not an object, the field missing, null or not a string) is
skipped and reported on stderr as ``skipped bad record FILE:LINE: reason`` (parquet: ``FILE:row R``); the manifest
counts them (``bad_records``, the first few by name in each shard's ``bad_examples``) and so does the summary line.
More than ``--max-bad-records`` (default 1000) stops prepare with a one-line error (exit status 2).

Validation hold-out (``--validation-split``, recorded in the manifest): ``tail`` holds out the last
``--validation-fraction`` of every document, the default for text and arrayrecord (few, large documents); ``docs``
holds out whole documents, those whose content hash falls below the fraction (:func:`lpt.data.documents.holds_out`:
about that share of the documents, identical documents in the same split, independent of the shard plan), the
default for jsonl and parquet (many documents).

The input files (sorted, ``**`` recursive) are grouped in order into shards of about ``--shard-mb`` MiB of input
(a larger file is a shard of its own). Each shard is tokenized by one worker process (``--workers``) exactly as the
on-the-fly path does (:func:`lpt.data.documents.encoded_parts`) and written to
``DIR/{train,validation}-iiiii.array_record`` in records of ``--record-tokens`` ids, with the shard's per-id counts
in ``DIR/counts-iiiii.npy`` and, at the end, their sum in ``DIR/counts.npy`` (layout: :mod:`lpt.data.prepared`).
The trainer reads the result with ``config.data.source="prepared"``, ``config.data.paths=DIR`` and the same
``config.data.tokenizer``.

Resumable: ``DIR/manifest.json`` is written first (the plan: tokenizer identity, settings, each shard's inputs
with size and mtime) and rewritten after every finished shard; a shard's files are written under temporary names
and renamed when complete (a rerun deletes the temporary files an interrupted run left). A rerun with the same
arguments skips the finished shards and gives byte-identical files and manifest; a rerun into the same DIR with
another tokenizer, other inputs or other settings (source, text field, validation split or fraction, record size)
is an error.

One prepare at a time per DIR: it holds an exclusive lock (:mod:`lpt.filelock`) on ``DIR/prepare.lock``, which names it
(host, pid, start time) and is removed when it ends; a second prepare into the same DIR fails at once with a one-line
error naming the directory and the holder (:class:`lpt.data.prepare_out.OutLock`). DIR must lie apart from the input:
DIR equal to an input file's directory, DIR containing one, or DIR inside one where the ``--input`` glob would match the
files prepare writes (``'in/**'``) is refused before anything is written (paths resolved, symlinks followed;
:func:`lpt.data.prepare_out.check_apart`). Each finished shard records a blake2b digest of each split's records
(``digest``), taken as they are written, which :mod:`lpt.data.identity` combines into the directory's identity.
Progress: a tqdm bar over the input bytes, on stderr when it is a terminal.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import sys
import time

import numpy as np

from lpt.data import cache, corpus, documents, prepare_out, prepared, records
from lpt.data.tokenizer import load_tokenizer, token_dtype

SOURCES = tuple(corpus._FILE_SOURCES)  # the file formats, shared with the trainer's on-the-fly path
_SHARD_MB = 64
_RECORD_TOKENS = 1 << 14
_AR_OPTIONS = "group_size:1"  # one record per chunk: every record is read on its own (random access)


def _plan_shards(files: list[str], shard_bytes: int) -> list[dict]:
    """Consecutive groups of ``files`` of about ``shard_bytes`` input bytes each: ``[{"index", "inputs": [[path,
    size, mtime_ns], ...]}]``."""
    shards, group, size = [], [], 0
    for f in files:
        st = os.stat(f)
        group.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
        size += st.st_size
        if size >= shard_bytes:
            shards.append(group)
            group, size = [], 0
    if group:
        shards.append(group)
    return [{"index": i, "inputs": g} for i, g in enumerate(shards)]


def _documents(task: dict, bad: records.BadRecords):
    paths = [path for path, _, _ in task["inputs"]]
    if task["source"] == "text":
        return ((path, path) for path in paths)  # a path: encoded in line-aligned pieces
    return corpus._FILE_SOURCES[task["source"]].read(paths, task["text_field"], bad)


def _report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _RecordWriter:
    """Writes one split's token stream of a shard as ArrayRecord records of ``record_tokens`` ids."""

    def __init__(self, path: str, dtype: np.dtype, record_tokens: int):
        from array_record.python.array_record_module import ArrayRecordWriter

        self.path, self.tmp = path, f"{path}.tmp-{os.getpid()}"
        self._writer = ArrayRecordWriter(self.tmp, _AR_OPTIONS)
        self.dtype, self.record_tokens = dtype.newbyteorder("<"), record_tokens
        self._pending: list[np.ndarray] = []
        self._n = 0
        self.hash = hashlib.blake2b(digest_size=16)  # of every record's bytes, in order

    def _write(self, record: bytes) -> None:
        self._writer.write(record)
        self.hash.update(record)

    def add(self, ids: np.ndarray) -> None:
        self._pending.append(ids.astype(self.dtype))  # native -> little-endian uint16 / uint32 (same values)
        self._n += ids.size
        if self._n >= self.record_tokens:
            flat = np.concatenate(self._pending)
            full = flat.size - flat.size % self.record_tokens
            for start in range(0, full, self.record_tokens):
                self._write(flat[start : start + self.record_tokens].tobytes())
            self._pending, self._n = [flat[full:]], flat.size - full

    def close(self) -> None:
        if self._n:
            flat = np.concatenate(self._pending)
            self._write(flat.tobytes())  # the shard's shorter last record
        self._writer.close()
        os.replace(self.tmp, self.path)


_TOKENIZERS: dict = {}  # per worker process


def tokenize_shard(task: dict) -> dict:
    """Tokenize one shard (``task``: out, index, inputs, source, text_field, tokenizer, validation_fraction,
    validation_split, record_tokens, max_bad_records) into its files; returns its counts ``{"index", "tokens",
    "bytes", "documents", "split_documents", "bad_records", "bad_examples"}`` and ``"digest"`` (per split: blake2b of
    its records' bytes in order, for :mod:`lpt.data.identity`). Each bad record is one stderr line."""
    tok = _TOKENIZERS.setdefault(task["tokenizer"], load_tokenizer(task["tokenizer"]))
    dtype = token_dtype(tok.vocab_size)
    out, index = task["out"], task["index"]
    counters = {s: cache.TokenCounter(tok, dtype) for s in documents.SPLITS}
    writers = {
        s: _RecordWriter(os.path.join(out, prepared.shard_file(s, index)), dtype, task["record_tokens"])
        for s in documents.SPLITS
    }
    n_documents, split_documents = 0, dict.fromkeys(documents.SPLITS, 0)
    bad = records.BadRecords(task["max_bad_records"], _report, "--max-bad-records")
    fraction, how = task["validation_fraction"], task["validation_split"]
    try:
        for name, doc in _documents(task, bad):
            n_documents += 1
            seen = set()
            for split, ids, nbytes in documents.encoded_parts(tok, doc, fraction, name, how):
                writers[split].add(counters[split].add(ids, nbytes))
                if len(ids):  # the bytes tokenizer hands over an empty part as one empty piece
                    seen.add(split)
            for split in seen:
                split_documents[split] += 1
    except BaseException:
        for w in writers.values():
            w._writer.close()
            os.remove(w.tmp)
        raise
    counts_path = os.path.join(out, prepared.counts_file(index))
    np.save(counts_path + ".tmp.npy", np.stack([counters[s].counts for s in documents.SPLITS]))
    os.replace(counts_path + ".tmp.npy", counts_path)
    for w in writers.values():
        w.close()
    return {
        "index": index,
        "tokens": {s: counters[s].tokens for s in documents.SPLITS},
        "bytes": {s: counters[s].text_bytes for s in documents.SPLITS},
        "documents": n_documents,
        "split_documents": split_documents,
        "bad_records": bad.count,
        "bad_examples": bad.examples,
        "digest": {s: w.hash.hexdigest() for s, w in writers.items()},
    }


def _first_bad(manifest: dict) -> str | None:
    return next((e for f in manifest["finished"].values() for e in f.get("bad_examples", [])), None)


def _check_bad_records(manifest: dict, limit: int) -> None:
    """ValueError (one line) when the finished shards hold more than ``limit`` bad records together."""
    bad = sum(f.get("bad_records", 0) for f in manifest["finished"].values())
    if bad > limit:
        raise ValueError(
            f"{bad} bad records, more than --max-bad-records={limit} allows (the first: {_first_bad(manifest)}); "
            "fix the input or raise the limit"
        )


def prepare(
    tokenizer: str,
    input: str,
    out: str,
    *,
    source: str | None = None,
    text_field: str | None = None,
    validation_fraction: float = 0.1,
    validation_split: str | None = None,
    max_bad_records: int = records.MAX_BAD_RECORDS,
    workers: int = 1,
    shard_mb: float = _SHARD_MB,
    record_tokens: int = _RECORD_TOKENS,
    progress: bool = True,
) -> dict:
    """Prepare (or finish preparing) ``out`` (see the module docstring); returns the manifest plus ``"tokenized"``:
    the indices of the shards this call tokenized. ``workers == 1`` tokenizes in this process. ``source``,
    ``text_field`` and ``validation_split`` left at None take the input's format, ``"text"`` and that format's
    split.

    Args:
      tokenizer: ``"bytes"`` or a tokenizer file (:func:`lpt.data.tokenizer.load_tokenizer`); ``--tokenizer``.
      input: glob of the input files (``~`` expanded, ``**`` recursive); ``--input``.
      out: the directory to write (created if missing); ``--out``.
      source: the input format, one of the file sources (``text``, ``arrayrecord``, ``jsonl``, ``parquet``); None:
        from the file names.
      text_field: the field of a jsonl / parquet record that holds the text; not for the other formats. None:
        ``"text"``.
      validation_fraction: share held out for validation, in (0, 1).
      validation_split: ``"tail"`` or ``"docs"`` (:data:`lpt.data.documents.VALIDATION_SPLITS`); None: the format's.
      max_bad_records: bad records skipped over all shards (an int >= 0) before it stops with a ValueError.
      workers: tokenizing processes, >= 1.
      shard_mb: input MiB per shard, > 0 (a larger file is a shard of its own).
      record_tokens: token ids per ArrayRecord record, >= 1.
      progress: show the tqdm bar over the input bytes.
    """
    if source is not None and source not in SOURCES:
        raise ValueError(f"--source {source!r} is not supported; allowed: {list(SOURCES)}")
    if validation_split is not None and validation_split not in documents.VALIDATION_SPLITS:
        raise ValueError(
            f"--validation-split {validation_split!r} is not supported; allowed: {list(documents.VALIDATION_SPLITS)}"
        )
    if text_field is not None and (not isinstance(text_field, str) or not text_field):
        raise ValueError(f"--text-field {text_field!r} must be a non-empty field name")
    if not isinstance(max_bad_records, int) or max_bad_records < 0:
        raise ValueError(f"--max-bad-records {max_bad_records!r} must be an int >= 0")
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"--validation-fraction {validation_fraction!r} must be in (0, 1)")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers {workers!r} must be an int >= 1")
    if not isinstance(record_tokens, int) or record_tokens < 1:
        raise ValueError(f"--record-tokens {record_tokens!r} must be an int >= 1")
    if not shard_mb > 0:
        raise ValueError(f"--shard-mb {shard_mb!r} must be > 0")
    out = os.path.expanduser(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} is a file; give a directory (created if missing)")
    tok = load_tokenizer(tokenizer)
    files = corpus.glob_files(input, source or "inferred", "--input")
    source = source or corpus.infer_source(files, f"--input {input!r}")
    fmt = corpus._FILE_SOURCES[source]
    if text_field is not None and not fmt.text_field:
        raise ValueError(
            f"--text-field {text_field!r} does not apply to --source {source}; it names the field of "
            f"{[k for k, v in corpus._FILE_SOURCES.items() if v.text_field]} records"
        )
    text_field = (text_field or "text") if fmt.text_field else None
    validation_split = validation_split or fmt.split
    manifest = {
        "format": prepared.FORMAT,
        "tokenizer": {
            "spec": tok.name,
            "identity": tok.identity,
            "vocab_size": tok.vocab_size,
            "separator": tok.separator,
        },
        "dtype": token_dtype(tok.vocab_size).name,
        "source": source,
        "text_field": text_field,
        "validation_fraction": float(validation_fraction),
        "validation_split": validation_split,
        "record_tokens": record_tokens,
        "shards": _plan_shards(files, int(shard_mb * (1 << 20))),
        "finished": {},
        "complete": False,
    }
    prepare_out.check_apart(out, files, input)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out!r} cannot be created: {e.strerror}") from None
    with prepare_out.OutLock(out):
        return _prepare_locked(out, manifest, tok, max_bad_records, workers, tokenizer, progress)


def _prepare_locked(
    out: str, manifest: dict, tok, max_bad_records: int, workers: int, tokenizer: str, progress: bool
) -> dict:
    """:func:`prepare` once it holds ``out``'s lock: check a rerun, tokenize the unfinished shards, sum up."""
    from tqdm import tqdm

    path = os.path.join(out, prepared.MANIFEST)
    if os.path.exists(path):
        old = prepare_out.read_manifest(path)
        prepare_out.check_rerun(out, old, manifest)
        manifest["finished"] = {
            k: v
            for k, v in old["finished"].items()
            if all(
                os.path.exists(os.path.join(out, f))
                for f in (*(prepared.shard_file(s, int(k)) for s in documents.SPLITS), prepared.counts_file(int(k)))
            )
        }
    prepare_out.remove_temporary(out)  # files an interrupted run left half-written
    prepare_out.write_manifest(out, manifest)
    settings = {
        "out": out,
        "source": manifest["source"],
        "text_field": manifest["text_field"],
        "tokenizer": str(tokenizer),
        "validation_fraction": manifest["validation_fraction"],
        "validation_split": manifest["validation_split"],
        "record_tokens": manifest["record_tokens"],
        "max_bad_records": max_bad_records,
    }
    tasks = [{**settings, **s} for s in manifest["shards"] if str(s["index"]) not in manifest["finished"]]
    sizes = {t["index"]: sum(size for _, size, _ in t["inputs"]) for t in tasks}
    bar = tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc=f"prepare {out}", disable=not progress)
    tokenized = []

    def done(result: dict) -> None:
        i = result.pop("index")
        manifest["finished"][str(i)] = result
        manifest["finished"] = dict(sorted(manifest["finished"].items(), key=lambda kv: int(kv[0])))
        prepare_out.write_manifest(out, manifest)
        tokenized.append(i)
        bar.update(sizes[i])
        _check_bad_records(manifest, max_bad_records)

    try:
        if workers == 1 or len(tasks) <= 1:
            for t in tasks:
                done(tokenize_shard(t))
        else:
            with multiprocessing.get_context("spawn").Pool(min(workers, len(tasks))) as pool:
                for result in pool.imap_unordered(tokenize_shard, tasks):
                    done(result)
    finally:
        bar.close()
    _check_bad_records(manifest, max_bad_records)  # counts every shard in the manifest, resumed ones included
    for key in ("tokens", "bytes"):
        manifest[key] = {s: sum(f[key][s] for f in manifest["finished"].values()) for s in documents.SPLITS}
    finished = manifest["finished"].values()
    manifest["documents"] = sum(f["documents"] for f in finished)
    per_split = [f.get("split_documents", {}) for f in finished]
    manifest["split_documents"] = {s: sum(d.get(s, 0) for d in per_split) for s in documents.SPLITS}
    manifest["bad_records"] = sum(f.get("bad_records", 0) for f in finished)
    total = np.zeros((len(documents.SPLITS), tok.vocab_size), np.int64)
    for s in manifest["shards"]:
        total += np.load(os.path.join(out, prepared.counts_file(s["index"])))
    np.save(os.path.join(out, prepared.TOTAL_COUNTS + ".tmp.npy"), total)
    os.replace(os.path.join(out, prepared.TOTAL_COUNTS + ".tmp.npy"), os.path.join(out, prepared.TOTAL_COUNTS))
    manifest["complete"] = True
    prepare_out.write_manifest(out, manifest)
    return {**manifest, "tokenized": sorted(tokenized)}


def main(argv: list[str] | None = None) -> int:
    """The CLI (see the module docstring); returns the exit status: 0 done, 2 bad input (one line on stderr)."""
    parser = argparse.ArgumentParser(prog="python -m lpt.data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="'bytes', a tokenizer.json or a SentencePiece .model")
    parser.add_argument("--input", required=True, help="glob of input files ('**' recursive; quote it)")
    parser.add_argument("--out", required=True, help="output directory (created; rerun to resume)")
    parser.add_argument(
        "--source",
        default=None,
        choices=SOURCES,
        help="text: a file is a document; arrayrecord, jsonl, parquet: a record is a document (default: from the "
        "file names: .array_record, .jsonl/.ndjson[.gz|.zst], .parquet, else text)",
    )
    parser.add_argument("--text-field", default=None, help="jsonl / parquet: the field holding the text (default text)")
    parser.add_argument("--validation-fraction", type=float, default=0.1, help="share held out for validation")
    parser.add_argument(
        "--validation-split",
        default=None,
        choices=documents.VALIDATION_SPLITS,
        help="tail: the end of every document; docs: whole documents, by content hash (default: docs for jsonl and "
        "parquet, tail for text and arrayrecord)",
    )
    parser.add_argument(
        "--max-bad-records",
        type=int,
        default=records.MAX_BAD_RECORDS,
        help="bad records skipped (each reported on stderr) before prepare stops with an error",
    )
    parser.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)), help="processes")
    parser.add_argument("--shard-mb", type=float, default=_SHARD_MB, help="input MiB per shard")
    parser.add_argument("--record-tokens", type=int, default=_RECORD_TOKENS, help="token ids per ArrayRecord record")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        # the options' dests are prepare's parameter names; the bar is shown on a terminal only, so that a logged
        # stderr holds the bad-record and error lines alone
        m = prepare(**vars(args), progress=sys.stderr.isatty())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    total = sum(m["bytes"].values())
    docs = m["split_documents"]
    bad = f", {m['bad_records']} bad records skipped (first: {_first_bad(m)})" if m["bad_records"] else ""
    print(
        f"{args.out}: {m['source']}, {len(m['shards'])} shards ({len(m['tokenized'])} tokenized now), "
        f"{m['documents']} documents (with text in train {docs['train']}, validation {docs['validation']}: "
        f"{m['validation_split']} split){bad}, tokens train {m['tokens']['train']:,} validation "
        f"{m['tokens']['validation']:,}, {total / max(1, sum(m['tokens'].values())):.3f} bytes/token; {dt:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
