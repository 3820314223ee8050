"""lpt.data: grain pipelines over byte-level corpora (vocab 256).

Public API
----------
``make_train_iterator(data_cfg, *, seq_len, global_batch, process_index=0, process_count=1, seed=0)``
    infinite checkpointable grain iterator of ``{"inputs", "targets"}: int32[global_batch // process_count,
    seq_len]`` numpy dicts (``get_state()`` / ``set_state()`` JSON-able; orbax: ``grain.checkpoint.CheckpointSave``
    / ``CheckpointRestore``).
``make_eval_batches(data_cfg, *, seq_len, batch, num_batches, process_index=0, process_count=1,
split="validation")`` -> list of such dicts (deterministic; ``batch`` is the global batch).
``unigram_loss(data_cfg, split="validation") -> float`` nats/token baseline.
``token_streams(source, paths, validation_fraction, cache_dir=None)``, ``streams_and_counts(...)``,
``load_documents(source, paths)``, ``data_options(cfg)``.

``config.data`` keys: source ("embedded" | "text" | "arrayrecord"), paths (glob), seq_len (unused here: pass
``seq_len=``), validation_fraction (0.1), worker_count (0), shuffle_seed (0), cache_dir (None: $LPT_DATA_CACHE or
~/.cache/lpt/data; where file sources are cached as memory-mapped token streams). See docs/models_and_data.md.
"""

from lpt.data.corpus import SEPARATOR, SOURCES, VOCAB_SIZE, load_documents, streams_and_counts, token_streams
from lpt.data.pipeline import Windows, data_options, make_eval_batches, make_train_iterator, unigram_loss

__all__ = [
    "SEPARATOR",
    "SOURCES",
    "VOCAB_SIZE",
    "Windows",
    "data_options",
    "load_documents",
    "streams_and_counts",
    "make_eval_batches",
    "make_train_iterator",
    "token_streams",
    "unigram_loss",
]
