"""grain pipelines: packed windows, per-process shards of a global batch, iterators from any batch, eval batches.

Packing (concatenate-then-split): the split's token stream (documents joined by the tokenizer's separator, see
:mod:`lpt.data.corpus`; for ``source="prepared"`` read with random access from ArrayRecord shards) is cut into
windows ``w_i = stream[i·L : i·L + L + 1]`` for ``i < ⌊(N − 1)/L⌋``, and ``inputs = w_i[:-1]``,
``targets = w_i[1:]``. Windows cross document boundaries (GPT-2 style, no attention reset).

Training order: a grain ``MapDataset`` of windows, shuffled with the seed and repeated forever (each epoch
reshuffled). The global batch ``b`` is rows ``b·G … b·G + G − 1`` of that sequence; process ``p`` of ``P`` gets rows
``p·(G/P) … (p+1)·(G/P) − 1`` of it. So the global batch does not depend on the process count, the shards are
disjoint and cover it, and the data position is one integer, the next global batch index: the trainer resumes at
step ``s`` with ``start=s`` (:func:`make_train_iterator`), for any process count and worker count. With
``worker_count > 0`` grain's multiprocess prefetch gives the same batches (checked); its workers exit when the
trainer dies, also on SIGKILL (:mod:`lpt.data.workers`).
"""

from __future__ import annotations

import grain
import numpy as np

from lpt.data.cache import Corpus
from lpt.data.corpus import SOURCES, load_corpus
from lpt.data.workers import exit_with_parent
from lpt.options import SEED, Range, at_least, build, option, section


@section("data")
class DataConfig:
    """The ``data`` section of a config: where the tokens come from and how they are read."""

    source: str = option(
        "embedded",
        '"embedded" (pydoc_data.topics) | "text" (files) | "arrayrecord" | "jsonl" | "parquet" (a record\'s "text")'
        ' | "prepared" (python -m lpt.data.prepare)',
        SOURCES,
    )
    paths: str = option("", "glob of the input files (text, arrayrecord, jsonl, parquet) or the prepared directory")
    seq_len: int = option(64, "tokens per training sequence", bounds=at_least(1))
    validation_fraction: float = option(
        0.1, "share of the corpus held out for validation", bounds=Range(0, 1, low_open=True, high_open=True)
    )
    worker_count: int = option(
        0, "grain worker processes (0 = in-process; may change between runs)", bounds=at_least(0, note="0 = in-process")
    )
    shuffle_seed: int = option(0, "seed of the training data order", bounds=SEED)
    cache_dir: str = option("", 'tokenized-corpus cache; "" = $LPT_DATA_CACHE, else ~/.cache/lpt/data')
    tokenizer: str = option("bytes", '"bytes" (vocab 256) | a Hugging Face tokenizer.json | a SentencePiece .model')

    def check(self):
        if not self.tokenizer:
            raise ValueError(
                f"config.data.tokenizer={self.tokenizer!r} must be 'bytes' or the path of a tokenizer.json / .model"
            )


def data_options(data_cfg: DataConfig | None = None) -> DataConfig:
    """The data section (a DataConfig, returned as is, or a partial mapping of its keys); ValueError naming unknown
    keys / bad values."""
    return build(DataConfig, data_cfg)


def _corpus(opts: DataConfig) -> Corpus:
    paths = opts.paths if opts.source != "embedded" else None
    return load_corpus(opts.source, paths, opts.validation_fraction, opts.cache_dir or None, opts.tokenizer)


def _streams(opts: DataConfig) -> dict[str, np.ndarray]:
    return _corpus(opts).streams


class Windows:
    """Random access to the packed windows of a token stream (see module docstring)."""

    def __init__(self, stream: np.ndarray, seq_len: int):
        if not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len={seq_len!r} must be a positive int")
        self.stream, self.seq_len = stream, seq_len
        self.n = (stream.size - 1) // seq_len
        if self.n < 1:
            raise ValueError(f"token stream of {stream.size} tokens is too short for seq_len={seq_len}")

    def __len__(self) -> int:
        return self.n

    def __reduce__(self):
        # grain pickles the source into its worker processes: send a memory-mapped stream as its file name
        if isinstance(self.stream, np.memmap) and self.stream.filename:
            return (_windows_from_file, (self.stream.filename, self.stream.dtype.name, self.seq_len))
        return (Windows, (self.stream, self.seq_len))

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i) % self.n
        return self.stream[i * self.seq_len : (i + 1) * self.seq_len + 1]


def _windows_from_file(filename: str, dtype: str, seq_len: int) -> Windows:
    return Windows(np.memmap(filename, dtype=np.dtype(dtype), mode="r"), seq_len)


def _check_batch(global_batch: int, process_index: int, process_count: int) -> int:
    if not isinstance(process_count, int) or process_count < 1:
        raise ValueError(f"process_count={process_count!r} must be a positive int")
    if not isinstance(process_index, int) or not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index!r} must be in [0, {process_count})")
    if not isinstance(global_batch, int) or global_batch <= 0 or global_batch % process_count:
        raise ValueError(f"global batch {global_batch!r} is not divisible by the process count {process_count}")
    return global_batch // process_count


def _to_example(rows: list[np.ndarray]) -> dict[str, np.ndarray]:
    w = np.stack(rows).astype(np.int32)  # uint8 / uint16 / uint32 token ids -> int32
    # contiguous copies, not views of w: grain's workers pass contiguous arrays through shared memory and pickle the
    # rest through a pipe, where a batch larger than the pipe keeps a stopping worker alive until it is killed
    return {"inputs": np.ascontiguousarray(w[:, :-1]), "targets": np.ascontiguousarray(w[:, 1:])}


class _ProcessBatches(grain.MapDataset):
    """Element ``b`` = this process's rows of global batch ``b`` of ``parent`` (a per-row MapDataset)."""

    def __init__(self, parent: grain.MapDataset, global_batch: int, process_index: int, process_count: int):
        super().__init__(parent)
        self.local = _check_batch(global_batch, process_index, process_count)
        self.global_batch, self.process_index = global_batch, process_index

    def __len__(self) -> int:
        return len(self._parent) // self.global_batch

    def __getitem__(self, b):
        if isinstance(b, slice):
            return self.slice(b)
        start = int(b) * self.global_batch + self.process_index * self.local
        return _to_example([self._parent[start + j] for j in range(self.local)])

    def __str__(self) -> str:
        return f"_ProcessBatches(global_batch={self.global_batch}, process_index={self.process_index})"


def _shuffle_seed(opts: DataConfig, seed: int) -> int:
    return int(np.random.SeedSequence([opts.shuffle_seed, int(seed)]).generate_state(1)[0] & 0x7FFFFFFF)


def make_train_iterator(
    data_cfg: DataConfig,
    *,
    seq_len: int,
    global_batch: int,
    process_index: int = 0,
    process_count: int = 1,
    seed: int = 0,
    start: int = 0,
) -> grain.DatasetIterator:
    """Infinite iterator of ``{"inputs", "targets"}: int32[global_batch // process_count, seq_len]`` (numpy), this
    process's rows of global batches ``start, start + 1, …``.

    Order is a function of ``(config.data.shuffle_seed, seed)`` only, so the iterator at ``start`` continues one
    that yielded ``start`` batches, whatever the process count or worker count of either. ``worker_count > 0``
    prefetches in that many worker processes (grain ``mp_prefetch``); the batches are the same for every worker
    count.

    Args:
      data_cfg: a :class:`DataConfig`, or a partial mapping of its keys (:func:`data_options`).
      seq_len: tokens per row (windows of ``seq_len + 1`` tokens).
      global_batch: rows per global batch, divisible by ``process_count``.
      process_index, process_count: this process and the number of processes; this process gets the
        ``global_batch / process_count`` consecutive rows of each global batch from row
        ``process_index · global_batch / process_count`` on.
      seed: mixed with ``data.shuffle_seed`` into the shuffle seed.
      start: the first global batch index (an int >= 0): the step to resume at.
    """
    opts = data_options(data_cfg)
    _check_batch(global_batch, process_index, process_count)
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start={start!r} must be an int >= 0 (a global batch index)")
    rows = grain.MapDataset.source(Windows(_streams(opts)["train"], seq_len))
    rows = rows.shuffle(seed=_shuffle_seed(opts, seed)).repeat()
    ds = _ProcessBatches(rows, global_batch, process_index, process_count)[start:].to_iter_dataset()
    if opts.worker_count > 0:
        from absl import flags

        if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; outside absl.app nobody parsed them
            flags.FLAGS.mark_as_parsed()
        # each worker exits when this process dies, however it dies (lpt.data.workers)
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=opts.worker_count), exit_with_parent)
    return iter(ds)


def make_eval_batches(
    data_cfg: DataConfig,
    *,
    seq_len: int,
    batch: int,
    num_batches: int,
    process_index: int = 0,
    process_count: int = 1,
    split: str = "validation",
) -> list[dict[str, np.ndarray]]:
    """The first ``num_batches`` global batches of ``batch`` consecutive windows of ``split`` (no shuffling), this
    process's rows of each. ValueError if the split has fewer than ``batch · num_batches`` windows.

    Args:
      data_cfg: a :class:`DataConfig`, or a partial mapping of its keys (:func:`data_options`).
      seq_len: tokens per row (windows of ``seq_len + 1`` tokens).
      batch: rows per global batch, divisible by ``process_count``.
      num_batches: how many global batches.
      process_index, process_count: this process and the number of processes; each gets its ``batch / process_count``
        consecutive rows of every batch.
      split: ``"train"`` or ``"validation"``.
    """
    opts = data_options(data_cfg)
    local = _check_batch(batch, process_index, process_count)
    if split not in ("train", "validation"):
        raise ValueError(f"split={split!r}; allowed: ['train', 'validation']")
    windows = Windows(_streams(opts)[split], seq_len)
    if batch * num_batches > len(windows):
        raise ValueError(
            f"{num_batches} eval batches of {batch} need {batch * num_batches} windows of length {seq_len}, but the "
            f"{split} split has only {len(windows)}; lower train.eval_batches or the batch"
        )
    out = []
    for b in range(num_batches):
        start = b * batch + process_index * local
        out.append(_to_example([windows[start + j] for j in range(local)]))
    return out


def unigram_loss(data_cfg: DataConfig, split: str = "validation") -> float:
    """Cross-entropy (nats/token) of the ``split`` stream's targets under the train split's token frequencies
    (add-one smoothed over the tokenizer's V ids): ``−mean_t log p(x_t)`` over ``t ≥ 1``,
    ``p(v) = (c_train(v) + 1) / (N_train + V)``. The baseline a model must beat. Computed from token counts (kept in
    the cache's meta.json / counts.npy and the prepared directory's counts files), so it costs nothing on large
    corpora."""
    opts = data_options(data_cfg)
    streams, counts, _ = _corpus(opts)
    if split not in streams:
        raise ValueError(f"split={split!r}; allowed: {sorted(streams)}")
    train = counts["train"].astype(np.float64)
    logp = np.log(train + 1.0) - np.log(train.sum() + train.size)
    target = counts[split].astype(np.float64)
    target[int(streams[split][0])] -= 1.0  # the first token is never a target
    return float(-(target * logp).sum() / target.sum())


def bytes_per_token(data_cfg: DataConfig, split: str = "validation") -> float:
    """Text bytes per token of ``split``: its UTF-8 bytes plus one per document separator (the NUL byte the bytes
    tokenizer writes there), divided by its tokens; exactly 1.0 for ``data.tokenizer="bytes"``. Bits per byte of a
    loss of L nats/token = ``L / ln 2 / bytes_per_token``. From the byte counts recorded beside the token counts,
    so it costs nothing on large corpora."""
    opts = data_options(data_cfg)
    if split not in ("train", "validation"):
        raise ValueError(f"split={split!r}; allowed: ['train', 'validation']")
    corpus = _corpus(opts)
    return corpus.text_bytes[split] / int(corpus.streams[split].size)
