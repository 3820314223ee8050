"""What a run trains on, as a small JSON-serializable dict: :func:`corpus_identity`; and what differs between two of
them, one phrase per difference: :func:`corpus_changes`.

``corpus_identity(data_cfg)`` opens the corpus as the pipeline does (building or verifying the token cache of a file
source, :mod:`lpt.data.cache`, once per process: the pipeline then reuses it) and returns::

    {"version": 1, "source": "text", "tokenizer": "bytes", "validation_fraction": 0.1,
     "files": {"a.txt": {"size": 6800, "digest": "3f0c…"}, "sub/b.txt": {"size": 4500, "digest": "9a1e…"}},
     "streams": {"train": {"tokens": 10170, "digest": "c2d4…"}, "validation": {"tokens": 1132, "digest": "07be…"}}}

* ``tokenizer``: the tokenizer's identity (``"bytes"`` or ``"sha256:…"`` of its file), so a retrained tokenizer at
  the same path is a different corpus.
* ``files``: the inputs by name, relative to the directory the ``data.paths`` glob starts in (the part before its
  first wildcard), so the same corpus mounted elsewhere has the same identity; each with its size and sampled
  digest (:func:`lpt.data.cache.digest`). The token cache records these in its ``meta.json`` when it is built, so
  no input is read again at start-up. Modification times are left out: a copied corpus is the same corpus.
* ``streams``: each split's token count and the digest of all of its tokens: for file sources the cache's
  ``full_digest`` (every byte, checked when the cache is opened), for the embedded corpus the same digest of the
  in-memory stream.

The embedded corpus has one "file", ``pydoc_data.topics`` (the deduplicated help texts of this Python, their size
and a digest of all of them). A prepared directory (``source="prepared"``) is identified by its manifest: ``files``
are the inputs it was prepared from (relative to their common directory; size, no digest: ``prepare`` records
none), ``tokenizer`` and ``validation_fraction`` the ones it was prepared with, and each split's digest combines
the digests ``prepare`` takes of every shard's records as it writes them (``None`` for a directory prepared by an
older lpt, whose shards have none: then the files, sizes and token counts are compared).
"""

from __future__ import annotations

import hashlib
import os

from lpt.data import cache, corpus, documents, prepared
from lpt.data.pipeline import DataConfig, _corpus, data_options
from lpt.data.tokenizer import load_tokenizer

_VERSION = 1
_KEYS = ("version", "source", "tokenizer", "validation_fraction", "files", "streams")


def _file_identity(source: str, paths: str, validation_fraction: float, cache_dir: str | None, tok) -> dict:
    files = corpus.glob_files(paths, source)
    fmt = corpus._FILE_SOURCES[source]
    key = cache.fingerprint(source, files, validation_fraction, tok.identity, fmt.split)
    meta = cache.read_meta(cache.cache_path(cache_dir, key))  # load_corpus built or verified it
    root = corpus.glob_root(paths)
    return {
        "files": {os.path.relpath(p, root): {"size": size, "digest": d} for p, size, d in meta["inputs"]},
        "streams": {s: {"tokens": int(meta["tokens"][s]), "digest": meta["full_digest"][s]} for s in documents.SPLITS},
    }


def _embedded_identity(streams: dict) -> dict:
    docs = corpus._embedded_documents()
    h = hashlib.blake2b(digest_size=16)
    for name, doc in docs:
        h.update(f"{name}\0{len(doc)}\0".encode())
        h.update(doc)
    size = sum(len(doc) for _, doc in docs)
    return {
        "files": {"pydoc_data.topics": {"size": size, "digest": h.hexdigest()}},
        "streams": {
            s: {"tokens": int(streams[s].size), "digest": cache.full_digest(streams[s])} for s in documents.SPLITS
        },
    }


def _prepared_identity(directory: str) -> dict:
    manifest = prepared.read_manifest(directory)
    inputs = [i for shard in manifest["shards"] for i in shard["inputs"]]
    root = os.path.commonpath([os.path.dirname(p) for p, _, _ in inputs]) if inputs else ""
    finished = [manifest["finished"][str(s["index"])] for s in manifest["shards"]]
    streams = {}
    for s in documents.SPLITS:
        digests = [f.get("digest", {}).get(s) for f in finished]
        if all(digests):
            h = hashlib.blake2b(digest_size=16)
            for d in digests:
                h.update(bytes.fromhex(d))
            digest = h.hexdigest()
        else:
            digest = None
        streams[s] = {"tokens": int(manifest["tokens"][s]), "digest": digest}
    return {
        "tokenizer": manifest["tokenizer"]["identity"],
        "validation_fraction": float(manifest["validation_fraction"]),
        "files": {os.path.relpath(p, root): {"size": size, "digest": None} for p, size, _ in inputs},
        "streams": streams,
    }


def corpus_identity(data_cfg: DataConfig) -> dict:
    """The identity of the corpus ``data_cfg`` (the ``config.data`` section, or a mapping of its keys) trains on (see
    the module docstring); JSON-serializable. Opens the corpus as the pipeline does, so its errors are the
    pipeline's."""
    opts = data_options(data_cfg)
    loaded = _corpus(opts)  # builds or verifies the cache; the pipeline reuses what this opened
    tok = load_tokenizer(opts.tokenizer)
    ident = {
        "version": _VERSION,
        "source": opts.source,
        "tokenizer": tok.identity,
        "validation_fraction": float(opts.validation_fraction),
    }
    if opts.source == "embedded":
        ident.update(_embedded_identity(loaded.streams))
    elif opts.source == "prepared":
        ident.update(_prepared_identity(opts.paths))
    else:
        ident.update(_file_identity(opts.source, opts.paths, opts.validation_fraction, opts.cache_dir or None, tok))
    return ident


def _check(ident, which: str) -> None:
    if not isinstance(ident, dict) or any(k not in ident for k in _KEYS):
        raise ValueError(
            f"the {which} corpus identity is not one corpus_identity returns (keys {list(_KEYS)}): {ident!r}"
        )


def corpus_changes(saved: dict, current: dict) -> list[str]:
    """One phrase per difference from ``saved`` to ``current`` (two :func:`corpus_identity` dicts, e.g. one stored
    in a checkpoint and one of today's corpus), ``[]`` when they are the same corpus: ``"source 'text' ->
    'jsonl'"``, ``"file c.txt added"``, ``"file a.txt deleted"``, ``"b.txt: size 100 -> 120"``, ``"b.txt: content
    changed (same size)"``, ``"train tokens 1000 -> 1200"``, ``"validation tokens changed (same count, 300)"``.
    ValueError (one line) when either is not such a dict."""
    _check(saved, "saved")
    _check(current, "current")
    if saved["version"] != current["version"]:
        return [f"corpus identity format {saved['version']!r} -> {current['version']!r}"]
    out = []
    for key in ("source", "tokenizer", "validation_fraction"):
        if saved[key] != current[key]:
            out.append(f"{key} {saved[key]!r} -> {current[key]!r}")
    old, new = saved["files"], current["files"]
    for name in sorted(new.keys() - old.keys()):
        out.append(f"file {name} added")
    for name in sorted(old.keys() - new.keys()):
        out.append(f"file {name} deleted")
    for name in sorted(old.keys() & new.keys()):
        a, b = old[name], new[name]
        if a["size"] != b["size"]:
            out.append(f"{name}: size {a['size']} -> {b['size']}")
        elif a["digest"] != b["digest"]:
            out.append(f"{name}: content changed (same size)")
    for split in documents.SPLITS:
        a, b = saved["streams"][split], current["streams"][split]
        if a["tokens"] != b["tokens"]:
            out.append(f"{split} tokens {a['tokens']} -> {b['tokens']}")
        elif a["digest"] != b["digest"]:
            out.append(f"{split} tokens changed (same count, {a['tokens']})")
    return out
