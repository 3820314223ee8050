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
``token_dtype(vocab_size)``: the stream dtype of a vocabulary (uint8 / uint16 / uint32).
``load_corpus(source, paths, validation_fraction, cache_dir=None, tokenizer="bytes")`` -> ``Corpus`` (streams,
counts, text_bytes); ``load_documents(source, paths)``, ``data_options(cfg)``, ``Windows``, ``PreparedStream`` (a
prepared directory's split, random access).
``corpus_identity(data_cfg) -> dict`` (:mod:`lpt.data.identity`): what the run trains on (source, tokenizer,
validation_fraction, the input files with their sizes and digests, each split's token count and digest),
JSON-serializable, from the token cache's meta.json (no input read again); ``corpus_changes(saved, current) ->
list[str]``: one phrase per difference ("file a.txt added", "b.txt: size 100 -> 120"), ``[]`` for the same corpus.

Command-line tools: ``python -m lpt.data.prepare`` (tokenize files into ArrayRecord shards for
``source="prepared"``) and ``python -m lpt.data.train_tokenizer`` (a byte-level BPE ``tokenizer.json``).

``DataConfig``: the typed ``config.data`` section (each key's type, default, allowed values and doc; ``seq_len`` is
unused here: pass ``seq_len=``); ``data_options(cfg)`` builds it from a ConfigDict or a partial mapping. See
docs/models_and_data.md.
"""

from lpt.data.cache import Corpus
from lpt.data.corpus import load_corpus, load_documents
from lpt.data.identity import corpus_changes, corpus_identity
from lpt.data.pipeline import (
    DataConfig,
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
    "Corpus",
    "DataConfig",
    "PreparedStream",
    "Windows",
    "bytes_per_token",
    "corpus_changes",
    "corpus_identity",
    "data_options",
    "load_corpus",
    "load_documents",
    "load_tokenizer",
    "make_eval_batches",
    "make_train_iterator",
    "token_dtype",
    "unigram_loss",
]
