"""What verifying a token cache costs when it is opened: the full digest of a 1 GB stream against reading it.

    python benchmarks/token_cache_check.py [--gb 1.0] [--dir DIR] [--rounds 3]

Writes a stream of ``--gb`` GB of random bytes into ``--dir`` (default: the system's temporary directory; the file
is deleted at the end) and times, best of ``--rounds``:

* read (the baseline): every byte read once into a 1 MiB buffer, one thread;
* full digest: :func:`lpt.data.cache.full_digest`, what every open of a cache checks (SHA-256 over 16 MiB chunks on
  ``os.cpu_count()`` threads), and the same on one thread;
* the alternatives in the standard library, one thread: blake2b over every byte, and zlib's crc32 (faster, but 32
  bits: it lets one damaged chunk in 2³² through);
* sampled digest: :func:`lpt.data.cache.digest`, the 64 blocks of 4 KiB an older lpt checked.

The file was just written, so these read from the page cache ("warm"); a second line per measurement drops the
file's pages first (``posix_fadvise(DONTNEED)`` after ``fsync``), so its bytes come from the disk ("cold"). Prints
MB/s (10⁶ bytes per second), the seconds for 1 GB, and each time as a ratio to the read of the same round.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import zlib

import numpy as np

from lpt.data import cache


def _read(path: str) -> None:
    buf = bytearray(1 << 20)
    with open(path, "rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass


def _blake2b(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        cache._chunk_digest(fd, 0, os.fstat(fd).st_size, "blake2b")
    finally:
        os.close(fd)


def _crc32(path: str) -> None:
    buf = bytearray(1 << 20)
    view, crc = memoryview(buf), 0
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _time(fn, path: str, cold: bool) -> float:
    if cold:
        _drop(path)
    t0 = time.perf_counter()
    fn(path)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="stream size in GB (10⁹ bytes)")
    parser.add_argument("--dir", default=None, help="where to write the stream (default: the temporary directory)")
    parser.add_argument("--rounds", type=int, default=3, help="best of this many rounds")
    args = parser.parse_args()
    size = int(args.gb * 1e9)
    fd, path = tempfile.mkstemp(suffix=".u16", dir=args.dir)
    os.close(fd)
    try:
        rng = np.random.default_rng(0)
        with open(path, "wb") as fh:
            for start in range(0, size, 1 << 26):
                fh.write(rng.integers(0, 256, min(1 << 26, size - start), dtype=np.uint8).tobytes())
        cases = {
            "read (baseline)": _read,
            f"full digest, {os.cpu_count()} threads": cache.full_digest,
            "full digest, 1 thread": lambda p: cache.full_digest(p, threads=1),
            "blake2b, 1 thread": _blake2b,
            "crc32, 1 thread": _crc32,
            "sampled digest (64 x 4 KiB)": cache.digest,
        }
        print(f"{size / 1e9:.2f} GB stream in {os.path.dirname(path)}, {os.cpu_count()} CPUs, best of {args.rounds}")
        for cold in (False, True):
            best = {name: min(_time(fn, path, cold) for _ in range(args.rounds)) for name, fn in cases.items()}
            base = best["read (baseline)"]
            for name, t in best.items():
                rate = size / t / 1e6
                print(
                    f"  {'cold' if cold else 'warm'}  {name:32s} {rate:9.0f} MB/s  {t / size * 1e9:7.3f} s per GB  "
                    f"{t / base:6.2f} x read"
                )
    finally:
        os.remove(path)


if __name__ == "__main__":
    main()
