"""``python -m lpt.data.prepare --tokenizer T --input GLOB --out DIR``: tokenize files into ArrayRecord shards.

The input files (sorted, ``**`` recursive) are grouped in order into shards of about ``--shard-mb`` MiB of input
(a larger file is a shard of its own). Each shard is tokenized by one worker process (``--workers``) exactly as the
on-the-fly path does (:func:`lpt.data.cache.encoded_parts`: one text file = one document, or with ``--source
arrayrecord`` one record = one document; the last ``--validation-fraction`` of every document goes to the
validation split) and written to ``DIR/{train,validation}-iiiii.array_record`` in records of ``--record-tokens``
ids, with the shard's per-id counts in ``DIR/counts-iiiii.npy`` and, at the end, their sum in ``DIR/counts.npy``
(layout: :mod:`lpt.data.prepared`). The trainer
reads the result with ``config.data.source="prepared"``, ``config.data.paths=DIR`` and the same
``config.data.tokenizer``.

Resumable: ``DIR/manifest.json`` is written first (the plan: tokenizer identity, settings, each shard's inputs
with size and mtime) and rewritten after every finished shard; a shard's files are written under temporary names
and renamed when complete (a rerun deletes the temporary files an interrupted run left). A rerun with the same
arguments skips the finished shards and gives byte-identical files and manifest; a rerun into the same DIR with
another tokenizer, other inputs or other settings is an error.
Progress: a tqdm bar over the input bytes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import time

import numpy as np

from lpt.data import cache, corpus, prepared
from lpt.data.tokenizer import load_tokenizer, token_dtype

SOURCES = ("text", "arrayrecord")
SHARD_MB = 64
RECORD_TOKENS = 1 << 14
AR_OPTIONS = "group_size:1"  # one record per chunk: every record is read on its own (random access)


def plan_shards(files: list[str], shard_bytes: int) -> list[dict]:
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


def _documents(source: str, inputs: list[list]):
    if source == "text":
        return ((path, path) for path, _, _ in inputs)  # a path: encoded in line-aligned pieces
    return corpus._FILE_SOURCES[source]([path for path, _, _ in inputs])


class _RecordWriter:
    """Writes one split's token stream of a shard as ArrayRecord records of ``record_tokens`` ids."""

    def __init__(self, path: str, dtype: np.dtype, record_tokens: int):
        from array_record.python.array_record_module import ArrayRecordWriter

        self.path, self.tmp = path, f"{path}.tmp-{os.getpid()}"
        self._writer = ArrayRecordWriter(self.tmp, AR_OPTIONS)
        self.dtype, self.record_tokens = dtype.newbyteorder("<"), record_tokens
        self._pending: list[np.ndarray] = []
        self._n = 0

    def add(self, ids: np.ndarray) -> None:
        self._pending.append(ids.astype(self.dtype))  # native -> little-endian uint16 / uint32 (same values)
        self._n += ids.size
        if self._n >= self.record_tokens:
            flat = np.concatenate(self._pending)
            full = flat.size - flat.size % self.record_tokens
            for start in range(0, full, self.record_tokens):
                self._writer.write(flat[start : start + self.record_tokens].tobytes())
            self._pending, self._n = [flat[full:]], flat.size - full

    def close(self) -> None:
        if self._n:
            flat = np.concatenate(self._pending)
            self._writer.write(flat.tobytes())  # the shard's shorter last record
        self._writer.close()
        os.replace(self.tmp, self.path)


_TOKENIZERS: dict = {}  # per worker process


def tokenize_shard(task: dict) -> dict:
    """Tokenize one shard (``task``: out, index, inputs, source, tokenizer, validation_fraction, record_tokens) into
    its files; returns its counts ``{"index", "tokens", "bytes", "documents"}``."""
    tok = _TOKENIZERS.setdefault(task["tokenizer"], load_tokenizer(task["tokenizer"]))
    dtype = token_dtype(tok.vocab_size)
    out, index = task["out"], task["index"]
    counters = {s: cache.TokenCounter(tok, dtype) for s in cache.SPLITS}
    writers = {
        s: _RecordWriter(os.path.join(out, prepared.shard_file(s, index)), dtype, task["record_tokens"])
        for s in cache.SPLITS
    }
    documents = 0
    try:
        for name, doc in _documents(task["source"], task["inputs"]):
            documents += 1
            for split, ids, nbytes in cache.encoded_parts(tok, doc, task["validation_fraction"], name):
                writers[split].add(counters[split].add(ids, nbytes))
    except BaseException:
        for w in writers.values():
            w._writer.close()
            os.remove(w.tmp)
        raise
    counts_path = os.path.join(out, prepared.counts_file(index))
    np.save(counts_path + ".tmp.npy", np.stack([counters[s].counts for s in cache.SPLITS]))
    os.replace(counts_path + ".tmp.npy", counts_path)
    for w in writers.values():
        w.close()
    return {
        "index": index,
        "tokens": {s: counters[s].tokens for s in cache.SPLITS},
        "bytes": {s: counters[s].text_bytes for s in cache.SPLITS},
        "documents": documents,
    }


_TEMPORARY = re.compile(
    r"(train|validation)-\d{5}\.array_record\.tmp-\d+|(counts-\d{5}|counts)\.npy\.tmp\.npy|manifest\.json\.tmp"
)


def _read_manifest(path: str) -> dict:
    """An existing ``manifest.json``; ValueError naming it when it is not a JSON object."""
    try:
        with open(path, "rb") as fh:
            manifest = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a prepare manifest (not JSON: {e}); use another --out") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} is not a prepare manifest (not a JSON object); use another --out")
    return manifest


def _write_manifest(out: str, manifest: dict) -> None:
    path = os.path.join(out, prepared.MANIFEST)
    with open(path + ".tmp", "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def _check_rerun(out: str, old: dict, new: dict) -> None:
    if old.get("format") != prepared.FORMAT:
        raise ValueError(f"{out!r} holds a manifest of format {old.get('format')!r}, not {prepared.FORMAT}")
    if old["tokenizer"]["identity"] != new["tokenizer"]["identity"]:
        raise ValueError(
            f"--out {out!r} was prepared with tokenizer {old['tokenizer']['spec']!r} ({old['tokenizer']['identity']}),"
            f" not --tokenizer {new['tokenizer']['spec']!r} ({new['tokenizer']['identity']}); use another --out"
        )
    for key in ("source", "validation_fraction", "record_tokens", "dtype", "shards"):
        if old[key] != new[key]:
            what = "inputs (files, sizes or mtimes)" if key == "shards" else f"{key} ({old[key]!r} vs {new[key]!r})"
            raise ValueError(f"--out {out!r} was prepared with other {what}; use another --out or delete it")


def prepare(
    tokenizer: str,
    input: str,
    out: str,
    *,
    source: str = "text",
    validation_fraction: float = 0.1,
    workers: int = 1,
    shard_mb: float = SHARD_MB,
    record_tokens: int = RECORD_TOKENS,
    progress: bool = True,
) -> dict:
    """Prepare (or finish preparing) ``out`` (see the module docstring); returns the manifest plus ``"tokenized"``:
    the indices of the shards this call tokenized. ``workers == 1`` tokenizes in this process."""
    from tqdm import tqdm

    if source not in SOURCES:
        raise ValueError(f"--source {source!r} is not supported; allowed: {list(SOURCES)}")
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
    files = corpus.glob_files(input, source, "--input")
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
        "validation_fraction": float(validation_fraction),
        "record_tokens": record_tokens,
        "shards": plan_shards(files, int(shard_mb * (1 << 20))),
        "finished": {},
        "complete": False,
    }
    path = os.path.join(out, prepared.MANIFEST)
    if os.path.exists(path):
        old = _read_manifest(path)
        _check_rerun(out, old, manifest)
        manifest["finished"] = {
            k: v
            for k, v in old["finished"].items()
            if all(
                os.path.exists(os.path.join(out, f))
                for f in (*(prepared.shard_file(s, int(k)) for s in cache.SPLITS), prepared.counts_file(int(k)))
            )
        }
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):  # files an interrupted run left half-written
        if _TEMPORARY.fullmatch(f):
            os.remove(os.path.join(out, f))
    _write_manifest(out, manifest)
    settings = {
        "out": out,
        "source": source,
        "tokenizer": str(tokenizer),
        "validation_fraction": float(validation_fraction),
        "record_tokens": record_tokens,
    }
    tasks = [{**settings, **s} for s in manifest["shards"] if str(s["index"]) not in manifest["finished"]]
    sizes = {t["index"]: sum(size for _, size, _ in t["inputs"]) for t in tasks}
    bar = tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc=f"prepare {out}", disable=not progress)
    tokenized = []

    def done(result: dict) -> None:
        i = result.pop("index")
        manifest["finished"][str(i)] = result
        manifest["finished"] = dict(sorted(manifest["finished"].items(), key=lambda kv: int(kv[0])))
        _write_manifest(out, manifest)
        tokenized.append(i)
        bar.update(sizes[i])

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
    for key in ("tokens", "bytes"):
        manifest[key] = {s: sum(f[key][s] for f in manifest["finished"].values()) for s in cache.SPLITS}
    manifest["documents"] = sum(f["documents"] for f in manifest["finished"].values())
    total = np.zeros((len(cache.SPLITS), tok.vocab_size), np.int64)
    for s in manifest["shards"]:
        total += np.load(os.path.join(out, prepared.counts_file(s["index"])))
    np.save(os.path.join(out, prepared.TOTAL_COUNTS + ".tmp.npy"), total)
    os.replace(os.path.join(out, prepared.TOTAL_COUNTS + ".tmp.npy"), os.path.join(out, prepared.TOTAL_COUNTS))
    manifest["complete"] = True
    _write_manifest(out, manifest)
    return {**manifest, "tokenized": sorted(tokenized)}


def main(argv: list[str] | None = None) -> int:
    """The CLI (see the module docstring); returns the exit status: 0 done, 2 bad input (one line on stderr)."""
    parser = argparse.ArgumentParser(prog="python -m lpt.data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="'bytes', a tokenizer.json or a SentencePiece .model")
    parser.add_argument("--input", required=True, help="glob of input files ('**' recursive; quote it)")
    parser.add_argument("--out", required=True, help="output directory (created; rerun to resume)")
    parser.add_argument(
        "--source",
        default="text",
        choices=SOURCES,
        help="text: a file is a document; arrayrecord: a record is a document",
    )
    parser.add_argument("--validation-fraction", type=float, default=0.1, help="tail of each document held out")
    parser.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)), help="processes")
    parser.add_argument("--shard-mb", type=float, default=SHARD_MB, help="input MiB per shard")
    parser.add_argument("--record-tokens", type=int, default=RECORD_TOKENS, help="token ids per ArrayRecord record")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        m = prepare(**vars(args))  # the options' dests are prepare's parameter names
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    total = sum(m["bytes"].values())
    print(
        f"{args.out}: {len(m['shards'])} shards ({len(m['tokenized'])} tokenized now), {m['documents']} documents, "
        f"tokens train {m['tokens']['train']:,} validation {m['tokens']['validation']:,}, "
        f"{total / max(1, sum(m['tokens'].values())):.3f} bytes/token; {dt:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
