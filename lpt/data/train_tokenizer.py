"""``python -m lpt.data.train_tokenizer --vocab-size N --out tok.json [--input GLOB]``: train a byte-level BPE.

A GPT-2 style byte-level BPE (the ``tokenizers`` package: ByteLevel pre-tokenizer with the GPT-2 split regex and no
prefix space, ByteLevel decoder, all 256 bytes in the initial alphabet, so every text encodes and decodes back
exactly) with one special token ``<|endoftext|>`` = id 0, which :func:`lpt.data.load_tokenizer` makes the document
separator. ``N`` = 256 bytes + 1 special token + the merges (at least 257; fewer ids result when the text has no
more pairs to merge). Trained only on the train split of the documents (the same cut as the data pipeline, so the
validation text is never seen): by default the embedded corpus (no download), else the text files matching
``--input`` (one file = one document, read in pieces). Deterministic: the same text gives the same file. An
``--out`` that is one of the input files, or that the ``--input`` glob would match, is refused before anything is
written.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator

from lpt.data import corpus, documents

_END_OF_TEXT = "<|endoftext|>"


def _train_texts(files: list[str] | None, validation_fraction: float) -> Iterator[str]:
    if files is None:
        docs = corpus.load_documents("embedded")
    else:
        docs = ((f, f) for f in files)  # paths: read in line-aligned pieces
    for name, doc in docs:
        train, _ = documents.text_parts(doc, validation_fraction)
        for piece in train:
            try:
                yield piece.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"document {name!r} is not UTF-8 text ({e.reason}); BPE trains on UTF-8") from None


def train_tokenizer(
    vocab_size: int,
    out: str,
    input: str | None = None,
    *,
    validation_fraction: float = 0.1,
    min_frequency: int = 2,
    progress: bool = True,
) -> dict:
    """Train the BPE (see the module docstring), save it to ``out``; returns ``{"vocab_size", "seconds",
    "train_bytes"}``.

    Args:
      vocab_size: ids in total, an int >= 257.
      out: the tokenizer.json to write (must end in ``.json``; neither an input file nor matched by ``input``).
      input: glob of UTF-8 text files, one document each; None: the embedded corpus.
      validation_fraction: the tail of each document not trained on, in (0, 1).
      min_frequency: pairs seen fewer times are not merged.
      progress: show the ``tokenizers`` trainer's progress bar.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not isinstance(vocab_size, int) or vocab_size < 257:
        raise ValueError(f"--vocab-size {vocab_size!r} must be an int >= 257 (256 bytes + {_END_OF_TEXT})")
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"--validation-fraction {validation_fraction!r} must be in (0, 1)")
    if not str(out).endswith(".json"):
        raise ValueError(f"--out {out!r} must end in .json (data.tokenizer tells tokenizer files by their suffix)")
    if os.path.isdir(out):
        raise ValueError(f"--out {out!r} is a directory; give the tokenizer.json file to write")
    files = None if input is None else corpus.glob_files(input, "text", "--input")
    if files is not None:  # before anything is written: the tokenizer file must not land among its inputs
        if os.path.realpath(out) in {os.path.realpath(f) for f in files}:
            raise ValueError(f"--out {out!r} is one of the --input files; writing it would overwrite that input")
        if corpus.glob_matches(input, out):
            raise ValueError(
                f"--out {out!r} lies where --input {input!r} reads: a rerun would train on the tokenizer file; "
                "write it outside the input"
            )
    t0 = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[_END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    seen = [0]

    def texts():
        for t in _train_texts(files, validation_fraction):
            seen[0] += len(t.encode("utf-8"))
            yield t

    tok.train_from_iterator(texts(), trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tok.save(str(out))
    return {
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "seconds": time.perf_counter() - t0,
        "train_bytes": seen[0],
    }


def main(argv: list[str] | None = None) -> int:
    """The CLI (see the module docstring); returns the exit status: 0 written, 2 bad input (one line on stderr)."""
    parser = argparse.ArgumentParser(prog="python -m lpt.data.train_tokenizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, required=True, help="ids in total (>= 257)")
    parser.add_argument("--out", required=True, help="the tokenizer.json to write")
    parser.add_argument("--input", default=None, help="glob of UTF-8 text files (default: the embedded corpus)")
    parser.add_argument("--validation-fraction", type=float, default=0.1, help="tail of each document not trained on")
    parser.add_argument("--min-frequency", type=int, default=2, help="pairs seen fewer times are not merged")
    args = parser.parse_args(argv)
    try:
        # tokenizers' progress bars go to stderr and end each with a newline on stdout, also when the bars are hidden:
        # shown on a terminal only, so that a piped or logged output holds the summary line alone
        progress = sys.stdout.isatty() and sys.stderr.isatty()
        r = train_tokenizer(**vars(args), progress=progress)  # the options' dests are train_tokenizer's parameter names
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out}: vocab {r['vocab_size']} ({_END_OF_TEXT} = 0, the separator), trained on "
        f"{r['train_bytes']:,} bytes in {r['seconds']:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
