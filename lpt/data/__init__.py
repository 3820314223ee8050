"""lpt.data: grain pipelines over tokenized corpora (bytes by default, or a tokenizer file).

Public API
----------
``make_train_iterator(data_cfg, *, seq_len, global_batch, process_index=0, process_count=1, seed=0)``
    infinite checkpointable grain iterator of ``{"inputs", "targets"}: int32[global_batch // process_count,
    seq_len]`` numpy dicts (``get_state()`` / ``set_state()`` JSON-able; orbax: ``grain.checkpoint.CheckpointSave``
    / ``CheckpointRestore``).
``make_eval_batches(data_cfg, *, seq_len, batch, num_batches, process_index=0, process_count=1,
split="validation")`` -> list of such dicts (deterministic; ``batch`` is the global batch).
``unigram_loss(data_cfg, split="validation") -> float`` nats/token baseline.
``bytes_per_token(data_cfg, split="validation") -> float`` text bytes per token (1.0 for bytes): bits per byte =
loss / ln 2 / bytes_per_token.
``load_tokenizer(spec)`` (:mod:`lpt.data.tokenizer`): ``vocab_size``, ``encode``, ``decode``, ``separator``.
``load_corpus(source, paths, validation_fraction, cache_dir=None, tokenizer="bytes")`` -> ``Corpus`` (streams,
counts, text_bytes); ``token_streams(...)``, ``streams_and_counts(...)`` (same arguments), ``load_documents(source,
paths)``, ``data_options(cfg)``, ``Windows``, ``PreparedStream`` (a prepared directory's split, random access).

Command-line tools: ``python -m lpt.data.prepare`` (tokenize files into ArrayRecord shards for
``source="prepared"``) and ``python -m lpt.data.train_tokenizer`` (a byte-level BPE ``tokenizer.json``).

``config.data`` keys: source ("embedded" | "text" | "arrayrecord" | "prepared"), paths (glob; for "prepared" the
directory), seq_len (unused here: pass ``seq_len=``), validation_fraction (0.1), worker_count (0), shuffle_seed (0),
cache_dir (None: $LPT_DATA_CACHE or ~/.cache/lpt/data; where file sources are cached as memory-mapped token
streams), tokenizer ("bytes" | a tokenizer.json | a SentencePiece .model). See docs/models_and_data.md.
"""

from lpt.data.cache import Corpus
from lpt.data.corpus import (
    SEPARATOR,
    SOURCES,
    VOCAB_SIZE,
    load_corpus,
    load_documents,
    streams_and_counts,
    token_streams,
)
from lpt.data.pipeline import (
    Windows,
    bytes_per_token,
    data_options,
    make_eval_batches,
    make_train_iterator,
    unigram_loss,
)
from lpt.data.prepared import PreparedStream
from lpt.data.tokenizer import load_tokenizer, token_dtype

__all__ = [
    "SEPARATOR",
    "SOURCES",
    "VOCAB_SIZE",
    "Corpus",
    "PreparedStream",
    "Windows",
    "bytes_per_token",
    "data_options",
    "load_corpus",
    "load_documents",
    "load_tokenizer",
    "make_eval_batches",
    "make_train_iterator",
    "streams_and_counts",
    "token_dtype",
    "token_streams",
    "unigram_loss",
]
