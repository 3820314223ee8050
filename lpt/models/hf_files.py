"""The safetensors files of a Hugging Face model directory, read and written with numpy.

The format: an 8-byte little-endian header length, a JSON header of ``{name: {dtype, shape, data_offsets}}``, then
the raw little-endian bytes. This module handles it itself, because not every ``safetensors`` release that lpt allows
reads BF16 into numpy; BF16 and FP8 arrays are ``ml_dtypes`` arrays. A directory holds ``model.safetensors`` or the
shards listed by ``model.safetensors.index.json`` (:func:`read_tensors`).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

# safetensors dtype codes <-> numpy dtypes (bfloat16 and float8 from ml_dtypes)
_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
ST_CODES = {v: k for k, v in _ST_DTYPES.items()}  # numpy dtype -> safetensors code
FLOAT_CODES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")  # the float codes among them


def read_json(file: str | Path) -> dict:
    """The JSON object in ``file`` (a model directory's config.json or safetensors index); ValueError naming the file
    when it is not UTF-8 JSON or holds something other than an object."""
    try:
        obj = json.loads(Path(file).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not a JSON file ({e})") from None
    if not isinstance(obj, dict):
        found = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(obj), "a number")
        raise ValueError(f"{file} holds {found}; expected a JSON object")
    return obj


def _is_index(x) -> bool:
    """Whether ``x`` is a JSON integer >= 0 (not a boolean)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_safetensors(file: str | Path) -> dict[str, np.ndarray]:
    """``{name: array}`` of one ``.safetensors`` file, memory-mapped (read-only), in the file's dtypes (BF16 and FP8
    as ``ml_dtypes`` arrays). ValueError naming the file when it is not a safetensors file (a header length past the
    end of the file, a header that is not a JSON object of ``{dtype, shape, data_offsets}`` entries, byte ranges
    that do not fit) or holds a dtype outside F64/F32/F16/BF16/F8/I*/U8/BOOL."""
    file = Path(file)
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{file} is not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        size = os.fstat(f.fileno()).st_size - 8 - n
        if size < 0:  # random bytes give a length of petabytes: never read that
            raise ValueError(
                f"{file} is not a safetensors file or is truncated: its header length says {n} bytes, "
                f"the file holds {size + n} after it"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} is not a safetensors file (its header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file} is not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + n, shape=(size,)) if size else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        info = info if isinstance(info, dict) else {}
        code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        lists = isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2
        if not (lists and all(map(_is_index, shape + offsets))):
            raise ValueError(
                f"{file}: tensor {name!r} has a malformed header entry; expected "
                '{"dtype": code, "shape": [ints >= 0], "data_offsets": [start, end]}'
            )
        shape, (start, end) = tuple(shape), offsets
        if not isinstance(code, str) or code not in _ST_DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has dtype {code}; supported: {sorted(_ST_DTYPES)}")
        dtype = _ST_DTYPES[code]
        if end - start != math.prod(shape) * dtype.itemsize or end > size:
            raise ValueError(
                f"{file}: tensor {name!r} ({code}, shape {shape}) has a byte range {start}..{end} "
                f"that does not fit its shape or the file's {size} data bytes"
            )
        out[name] = data[start:end].view(dtype).reshape(shape)  # little-endian bytes; lpt runs on little-endian hosts
    return out


def write_safetensors(file: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    """Write ``{name: array}`` as one ``.safetensors`` file (little-endian, tensors in name order, the header padded
    with spaces to a multiple of 8 bytes). ``metadata`` defaults to ``{"format": "pt"}``, which transformers asks
    for. The file is written under a temporary name and renamed into place, so a reader never sees half a file and
    arrays memory-mapped from the file it replaces (:func:`read_safetensors`) stay valid."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        if a.dtype not in ST_CODES:
            raise ValueError(f"tensor {name!r} has dtype {a.dtype}; supported: {sorted(map(str, ST_CODES))}")
        a = np.ascontiguousarray(a)
        header[name] = {
            "dtype": ST_CODES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        arrays.append(a)
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = Path(f"{file}.tmp-{os.getpid()}")  # renamed into place: readers of the old file (memory maps) keep it
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, file)


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face model directory: ``model.safetensors``, or the shards named by
    ``model.safetensors.index.json`` (each tensor must be in the shard the index names). File dtypes, memory-mapped."""
    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return read_safetensors(single)
    if not index.is_file():
        found = sorted(p.name for p in path.iterdir()) if path.is_dir() else "not a directory"
        raise ValueError(f"{path} holds neither model.safetensors nor model.safetensors.index.json (found: {found})")
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index} has no weight_map of tensor names to shard files")
    out = {}
    for shard in sorted(set(weight_map.values())):
        tensors = read_safetensors(path / shard)
        for name in tensors:
            if weight_map.get(name) != shard:
                raise ValueError(f"{path / shard}: tensor {name!r} is not listed for this shard in {index.name}")
        out.update(tensors)
    missing = sorted(set(weight_map) - set(out))
    if missing:
        raise ValueError(f"{index}: tensor {missing[0]!r} is listed but absent from {weight_map[missing[0]]}")
    return out
