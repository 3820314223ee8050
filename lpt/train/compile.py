"""``python -m lpt.train.compile --config CFG --topology TOPO [--config.key=value ...]``: will this run fit?

Compiles the trainer's own train step (``lpt.train.step.make_train_step``: same model, optimizer, shardings and
kernels) ahead of time for a TPU slice (``v5e:2x4``, ``v5p:2x2x1``, anything libtpu accepts) or a GPU node
(``h100:1x1x8``), on a machine with no accelerator (:mod:`lpt.targets`), and prints ONE JSON line on stdout: the
mesh, per-device memory (``compiled.memory_analysis()``) against the device's HBM, the step's matmul FLOPs (counted
from its jaxpr, loops by their trip counts: :mod:`lpt.targets.flops`), the compiler's roofline time
(``compiled.cost_analysis()``) where it holds, the implied MFU bound, the custom-call kernels and the collectives of
the compiled program (:mod:`lpt.targets.hlo`) and the compile time. No data is read: the batch is a
``ShapeDtypeStruct[global_batch, seq_len]`` int32 for inputs and targets.

Exit status: 0 the step compiles and fits; 1 it does not compile (the ``error`` field and a one-line ``error: ...`` on
stderr) or does not fit (``fits: false``, ``advice``: which knob to turn and by how much); 2 bad input (config,
unknown topology, a GPU topology without jax's CUDA plugin installed, a mesh that does not divide the topology's
devices, a batch that does not split over the mesh).

On TPU the compile runs with libtpu's ``--xla_tpu_no_crash_on_oom=true`` (set by :func:`main` before libtpu starts),
so a program that needs more than the HBM still compiles and reports its full requirement; without it libtpu stops at
the first allocation past the HBM and the message gives a lower bound (``temp_note`` says which). See docs/compile.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

from lpt import models, targets
from lpt.targets import flops as flops_lib
from lpt.targets import hlo
from lpt.train import config as config_lib
from lpt.train import loop
from lpt.train import state as state_lib
from lpt.train import step as step_lib

GIB = 1 << 30
_USAGE = "python -m lpt.train.compile --config CFG --topology TOPO [--config.key=value ...]"
_OOM = re.compile(r"HLO temporaries \(([\d.]+)([KMGT]?)\).*?available HBM \(([\d.]+)([KMGT]?)\)", re.S)
_ALLOC = re.compile(r"RESOURCE_EXHAUSTED: Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class _DoesNotCompile(RuntimeError):
    """The compiler rejected the train step (a Mosaic error, an XLA error, ...)."""


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def parse_tpu_oom(message: str) -> tuple[int, int] | None:
    """(temporaries bytes, available HBM bytes) from libtpu's ``RESOURCE_EXHAUSTED ... exceeds available HBM`` or
    ``RESOURCE_EXHAUSTED: Allocation (size=X) would exceed memory (size=Y)`` (then X is one buffer: a lower bound)."""
    m = _OOM.search(message)
    if m:
        return int(float(m.group(1)) * _UNITS[m.group(2)]), int(float(m.group(3)) * _UNITS[m.group(4)])
    m = _ALLOC.search(message)  # one buffer larger than the whole HBM (raised even with no_crash_on_oom)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _build(cfg: config_lib.Config, topology: str):
    """(mesh, jitted train step, sharded abstract state, batch structs): the trainer's own program
    (:func:`lpt.train.loop.program`) on a mesh of the topology's devices; ValueError on bad input."""
    mesh = loop.make_mesh(cfg, targets.devices(topology))
    prog = loop.program(cfg, mesh)
    return mesh, prog.train_step, state_lib.with_shardings(prog.abstract, prog.shardings), loop.batch_structs(cfg, mesh)


def shard_bytes(tree) -> int:
    """Bytes per device of a tree of ShapeDtypeStructs with shardings (the largest shard of each leaf)."""
    import jax

    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.shape != ()
    ) + sum(x.dtype.itemsize for x in jax.tree.leaves(tree) if x.shape == ())


def compile_step(cfg: config_lib.Config, topology: str) -> dict:
    """Compile ``cfg``'s train step for ``topology`` and return the report (see module docstring and docs/compile.md).

    Raises ValueError on bad input (also a GPU topology when jax's CUDA plugin, a ``dev`` extra, is not installed)
    and :class:`_DoesNotCompile` when the compiler rejects the step (except libtpu's HBM out-of-memory, which is
    reported with ``fits: false``)."""
    import jax

    cfg = config_lib.resolve(cfg)
    facts = targets.device_facts(topology)
    mesh, step, state, batch = _build(cfg, topology)
    n = mesh.size
    seq_len, global_batch = cfg.data.seq_len, cfg.train.global_batch
    model_flops = models.flops_per_token(cfg.model, seq_len) * global_batch * seq_len
    report = {
        "topology": topology,
        "platform": facts.platform,
        "device_kind": facts.device_kind,
        "devices": n,
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "global_batch": global_batch,
        "seq_len": seq_len,
        "microbatches": cfg.optim.microbatches,
        "remat": bool(cfg.model.remat),
        "params": sum(math.prod(x.shape) for x in jax.tree.leaves(state.params)),
        "state_bytes": shard_bytes(state),
        "fp8_codes_bytes": step_lib.fp8_codes_bytes(cfg.optim, state_lib.make_model_def(cfg), mesh),
        "batch_bytes": shard_bytes(batch),
        "hbm_bytes": facts.hbm_bytes,
        "peak_flops": facts.peak_flops,
        "model_flops": model_flops,
        "attention_impl": models.attention_impl(cfg.model, cfg.precision, mesh),
    }
    t0 = time.perf_counter()
    try:
        traced = step.trace(state, batch)
        lowered = traced.lower()
        t1 = time.perf_counter()
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 -- the compiler's errors come as several exception types
        text = str(e)
        oom = parse_tpu_oom(text)
        if oom is None:
            first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
            raise _DoesNotCompile(f"the train step does not compile for {topology}: {type(e).__name__}: {first}") from e
        report.update(_oom_report(report, *oom, seconds=time.perf_counter() - t0))
        report["advice"] = advise(cfg, report)
        return report
    t2 = time.perf_counter()
    report.update(_memory(compiled.memory_analysis(), facts))
    text = compiled.as_text()
    report["loops"] = [t for t in hlo.loop_trip_counts(text) if t > 1]
    counted = flops_lib.jaxpr_flops(traced.jaxpr) / n  # per device: the program's matmuls spread over the mesh
    report.update(_cost(compiled.cost_analysis(), counted, model_flops, n, facts.peak_flops, bool(report["loops"])))
    report["kernels"] = hlo.kernels(text)
    report["collectives"] = hlo.collectives(text)
    report["lower_seconds"] = round(t1 - t0, 2)
    report["compile_seconds"] = round(t2 - t1, 2)
    report["error"] = None
    report["advice"] = [] if report["fits"] else advise(cfg, report)
    return report


def _memory(ma, facts) -> dict:
    temp, note = int(ma.temp_size_in_bytes), None
    if facts.platform != "tpu":
        if temp == 0:
            temp, note = None, "XLA:GPU reported 0 temporaries for this program: unknown, not counted in total_bytes"
        else:
            note = "XLA:GPU buffer assignment; allocator fragmentation and cuBLAS/cuDNN workspaces are not included"
    out_extra = int(ma.output_size_in_bytes) - int(ma.alias_size_in_bytes)  # outputs not donated into arguments
    code = int(ma.generated_code_size_in_bytes)
    total = int(ma.argument_size_in_bytes) + out_extra + (temp or 0) + code
    return {
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
        "temp_bytes": temp,
        "temp_note": note,
        "generated_code_bytes": code,
        "total_bytes": total,
        "fits": total <= facts.hbm_bytes,
    }


def _oom_report(report: dict, temp: int, hbm: int, seconds: float) -> dict:
    args = report["state_bytes"] + report["batch_bytes"]
    return {
        "argument_bytes": args,
        "output_bytes": None,
        "alias_bytes": None,
        "temp_bytes": temp,
        "temp_note": "lower bound: libtpu stopped at the first allocation past the HBM (RESOURCE_EXHAUSTED); "
        "argument_bytes is the sharded state + batch computed from the shardings",
        "generated_code_bytes": None,
        "total_bytes": args + temp,
        "hbm_bytes": hbm,
        "fits": False,
        "flops": None,
        "optimal_seconds": None,
        "mfu_bound": None,
        "loops": None,
        "kernels": None,
        "collectives": None,
        "lower_seconds": None,
        "compile_seconds": round(seconds, 2),
        "error": "RESOURCE_EXHAUSTED: HLO temporaries exceed the available HBM",
    }


def _cost(ca, flops: float, model_flops: float, n: int, peak: float, looped: bool) -> dict:
    """``flops`` (matmul FLOPs per device and step, :func:`lpt.targets.flops.jaxpr_flops` of the traced step over the
    devices), ``optimal_seconds`` and ``mfu_bound = model_flops / (n · peak · optimal_seconds)``, with a note.

    ``optimal_seconds`` is XLA's roofline (compute and memory) for a program without loops; XLA's cost analysis
    counts a loop body once, so with loops (and on XLA:GPU, which has no cost analysis) it is the compute floor
    ``flops / peak``."""
    ca = ca[0] if isinstance(ca, list | tuple) and ca else ca
    secs, note = (ca or {}).get("optimal_seconds"), None
    if looped or not secs or secs <= 0:
        why = "the program has loops, which XLA's cost analysis counts once" if looped else "no XLA roofline"
        secs, note = flops / peak, f"{why}: optimal_seconds is the compute floor flops / peak_flops"
    bound = model_flops / (n * peak * secs) if secs else None
    return {"flops": flops, "optimal_seconds": secs, "mfu_bound": bound, "cost_note": note}


def advise(cfg: config_lib.Config, r: dict) -> list[str]:
    """Knobs that bring a step that does not fit under the HBM, with estimates (temporaries ~ per-device batch)."""
    hbm, temp = r["hbm_bytes"], r["temp_bytes"] or 0
    fixed = r["total_bytes"] - temp  # state, batch, outputs, code: independent of the microbatch size
    budget = 0.95 * hbm - fixed  # room for temporaries, 5% margin
    b, m = cfg.train.global_batch, cfg.optim.microbatches
    split = r["mesh"]["data"] * r["mesh"]["fsdp"]
    out = []
    if budget > 0 and temp:
        for m2 in range(m + 1, b + 1):
            if b % m2 == 0 and (b // m2) % split == 0 and temp * m / m2 <= budget:
                out.append(
                    f"set optim.microbatches={m2} (temps {_gib(temp)} -> ~{_gib(temp * m / m2)} GiB; same global "
                    f"batch in {m2} passes)"
                )
                break
        step = split * m
        fit_b = (b * budget / temp) // step * step
        if 0 < fit_b < b:
            out.append(f"set train.global_batch={int(fit_b)} (temps {_gib(temp)} -> ~{_gib(temp * fit_b / b)} GiB)")
    if not cfg.model.remat:
        out.append("set model.remat=true (recomputes block activations in the backward pass: fewer temps)")
    data, fsdp = r["mesh"]["data"], r["mesh"]["fsdp"]
    if data > 1:
        state = r["state_bytes"]
        out.append(
            f"set train.mesh.data=1 train.mesh.fsdp=-1 (state sharded {data * fsdp}-way instead of {fsdp}-way: "
            f"state {_gib(state)} -> ~{_gib(state * fsdp / (data * fsdp))} GiB)"
        )
    if budget <= 0:
        out.append(
            f"the state, batch and outputs alone take {_gib(fixed)} GiB of {_gib(hbm)} GiB: use more devices "
            f"(a larger topology; params shard over train.mesh.fsdp)"
        )
    return out


def _summary(r: dict) -> str:
    temp = "unknown" if r["temp_bytes"] is None else _gib(r["temp_bytes"])
    verdict = "fits" if r["fits"] else "does NOT fit"
    return (
        f"{r['topology']} ({r['devices']}x {r['device_kind']}, mesh {r['mesh']}): {_gib(r['total_bytes'])} GiB per "
        f"device (args {_gib(r['argument_bytes'])}, temps {temp}) of {_gib(r['hbm_bytes'])} GiB HBM: {verdict}; "
        f"attention: {r['attention_impl']}"
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(f"{message}; usage: {_USAGE}")


def main(argv: list[str] | None = None) -> int:
    """The CLI (see module docstring); returns the exit status."""
    # before any backend starts: importing lpt starts none; libtpu reads its flags in targets.devices (compile_step)
    targets.compile_only_environment()
    flag = "--xla_tpu_no_crash_on_oom=true"
    if flag not in os.environ.get("LIBTPU_INIT_ARGS", ""):
        os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {flag}".strip()

    parser = _Parser(prog="python -m lpt.train.compile", usage=_USAGE)
    parser.add_argument("--config", required=True, help="config file, e.g. configs/llama_1b.py")
    parser.add_argument("--topology", required=True, help="e.g. v5e:2x4, v5p:2x2x1, h100:1x1x8")
    try:
        args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
        overrides = config_lib.parse_overrides(rest)
        cfg = config_lib.apply_overrides(config_lib.load_config_file(args.config), overrides)
        report = compile_step(cfg, args.topology)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except _DoesNotCompile as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    report = {"config": args.config, "overrides": overrides, **report}
    print(json.dumps(report), flush=True)
    if not report["fits"]:
        advice = report["advice"][0] if report["advice"] else "no advice"
        print(f"error: does not fit: {_summary(report)}; try {advice}", file=sys.stderr)
        return 1
    print(_summary(report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
