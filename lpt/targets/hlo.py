"""What a compiled XLA program contains, read from its optimized HLO text (``compiled.as_text()``).

* :func:`kernels`: kernel -> count: custom-call targets (Mosaic/Pallas kernels show up as ``tpu_custom_call``, Pallas
  on GPU as ``__gpu$xla.gpu.triton``, cuBLAS as ``__cublas$gemm``, ...) and XLA:GPU's custom fusions (Triton GEMMs).
* :func:`collectives`: per kind (all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute), the number of
  distinct collectives in the program and the bytes of their results per device, both as written in the program
  (``count``, ``bytes``) and as executed in one run (``count_per_step``, ``bytes_per_step``: a collective inside a
  ``while`` body runs n times per step when its ``known_trip_count`` is n or its condition is ``i < constant(n)``,
  as for ``nnx.scan`` over layers and the microbatch ``lax.scan``; other loops count once).

An async pair counts once (the ``-start``; its result tuple holds the operands first, the results after them; ``-done``
is skipped). XLA:TPU splits one collective into several instructions that share a ``channel_id`` (start, continuation,
done fusions); instructions of one kind with the same ``channel_id`` count once, unless XLA named them as different
async collectives (``async_collective_name``): collectives of a ``shard_map`` body can share one ``channel_id``.
A fusion that calls an ``all-reduce-scatter`` computation (XLA:TPU's fused reduce-scatter) counts as a reduce-scatter.
"""

from __future__ import annotations

import collections
import re

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BITS = {
    "pred": 8,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (.*?) ([a-z][a-z0-9\-]*)\(")
_CALLEE = re.compile(r"\b(?:calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_CALLEE_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_ASYNC_NAME = re.compile(r'async_collective_name="([^"]+)"')
_REDUCE_SCATTER_FUSION = re.compile(r"\bcalls=%all-reduce-scatter\b")


def _bits(dtype: str) -> int:
    if dtype.startswith("f8") or dtype.startswith("f4"):
        return 8 if dtype.startswith("f8") else 4
    return _DTYPE_BITS.get(dtype, 0)


def array_bytes(shape_text: str) -> list[int]:
    """Bytes of each array in an HLO result type (``bf16[128,64]{1,0}`` or a tuple of them), in order."""
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append(n * _bits(dtype) // 8)
    return out


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _trip_count(line: str, comps: dict[str, list[str]]) -> int:
    """Trip count of a ``while`` instruction: its ``known_trip_count``, else ``N`` when its condition is
    ``counter < constant(N)`` (a scan from 0), else 1."""
    if " while(" not in line:
        return 1
    trip = _TRIP.search(line)
    if trip:
        return int(trip.group(1))
    cond = re.search(r"\bcondition=%([\w.\-]+)", line)
    body = comps.get(cond.group(1), []) if cond else []
    consts = [int(c) for ln in body for c in re.findall(r"= s32\[\]\S* constant\((\d+)\)", ln)]
    root = next((ln for ln in body if ln.lstrip().startswith("ROOT ")), "")
    return consts[0] if len(consts) == 1 and "compare(" in root and "direction=LT" in root else 1


def loop_trip_counts(text: str) -> list[int]:
    """Trip counts of the program's ``while`` loops (see :func:`_trip_count`)."""
    comps, _ = _computations(text)
    return [_trip_count(ln, comps) for lines in comps.values() for ln in lines if " while(" in ln]


def _multipliers(comps: dict[str, list[str]], entry: str | None) -> dict[str, int]:
    """Times each computation runs per execution of the entry computation."""
    callers: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            trip = _trip_count(line, comps)
            for callee in _CALLEE.findall(line):
                callers[callee].append((name, trip if f"body=%{callee}" in line else 1))
            for group in _CALLEE_LIST.findall(line):
                for callee in re.findall(r"%([\w.\-]+)", group):
                    callers[callee].append((name, 1))
    memo: dict[str, int] = {}

    def mult(name: str, seen: frozenset = frozenset()) -> int:
        if name == entry:
            return 1
        if name in memo:
            return memo[name]
        if name in seen:
            return 0
        memo[name] = sum(mult(p, seen | {name}) * f for p, f in callers.get(name, ()))
        return memo[name]

    return {name: mult(name) for name in comps}


def kernels(text: str) -> dict[str, int]:
    """Kernel name -> count: ``custom_call_target`` of every custom call, and the backend kind of every ``kCustom``
    fusion (XLA:GPU's Triton GEMMs ``__triton_nested_gemm_fusion``, cuDNN fusions, ...)."""
    names = re.findall(r'custom_call_target="([^"]+)"', text)
    for line in text.splitlines():
        if "kind=kCustom" in line:
            m = re.search(r'"fusion_backend_config":\{"kind":"([^"]+)"', line)
            names.append(m.group(1) if m else "kCustom fusion")
    return dict(sorted(collections.Counter(names).items()))


def _result_bytes(op: str, result: str) -> int:
    sizes = array_bytes(result)
    if not op.endswith("-start") or not result.startswith("("):
        return sum(sizes)
    kind = op[: -len("-start")]
    if kind == "collective-permute":
        return sizes[1] if len(sizes) > 1 else sum(sizes)
    if kind == "all-reduce":
        return sum(sizes)
    return sum(sizes[len(sizes) // 2 :])  # (operands..., results...)


def collectives(text: str) -> dict[str, dict[str, int]]:
    """Per collective kind: ``count``, ``bytes``, ``count_per_step``, ``bytes_per_step`` (see module docstring)."""
    comps, entry = _computations(text)
    mult = _multipliers(comps, entry)
    out = {k: {"count": 0, "bytes": 0, "count_per_step": 0, "bytes_per_step": 0} for k in KINDS}
    seen: set[tuple[str, str]] = set()
    for name, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            result, op = m.groups()
            kind = op[: -len("-start")] if op.endswith("-start") else op
            if op == "fusion" and _REDUCE_SCATTER_FUSION.search(line):
                kind = "reduce-scatter"  # XLA:TPU's fused reduce-scatter (an all-reduce-scatter emitter)
            if kind not in out:
                continue
            channel = _CHANNEL.search(line)
            if channel:
                async_name = _ASYNC_NAME.search(line)
                key = (kind, channel.group(1), async_name.group(1) if async_name else None)
                if key in seen:
                    continue
                seen.add(key)
            nbytes, times = _result_bytes(op, result), mult.get(name, 1)
            row = out[kind]
            row["count"] += 1
            row["bytes"] += nbytes
            row["count_per_step"] += times
            row["bytes_per_step"] += nbytes * times
    return out
