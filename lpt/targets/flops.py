"""The FLOPs a traced program asks for: its matmuls, read from the jaxpr before XLA rewrites them.

:func:`jaxpr_flops` sums ``2 · output elements · contracted size`` over every ``dot_general`` and the ``flops`` of
every ``pallas_call``'s ``cost_estimate`` (lpt's kernels declare theirs), recursing into sub-jaxprs: a ``scan`` body
times its length, a ``shard_map`` body times the mesh's device count (each device runs it), the largest branch of a
``cond``, a ``while`` body once (its trip count is not in the jaxpr). The jaxpr of a train step already holds the
backward pass and, under ``jax.checkpoint``, the recomputed forward. Elementwise work is not counted.

Counting the optimized HLO instead would need the FLOPs of XLA:TPU's windowed and base-dilated convolutions, into
which it rewrites batched and transposed matmuls; the jaxpr has the matmuls as written.
"""

from __future__ import annotations

import math

from jax.extend import core


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, tuple | list) else (v,):
            if isinstance(x, core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, core.Jaxpr):
                yield x


def jaxpr_flops(jaxpr) -> float:
    """Matmul FLOPs of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``), as in the module docstring."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs, out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
            total += 2.0 * math.prod(out) * math.prod(lhs[i] for i in contract)
            continue
        if name == "pallas_call":
            estimate = eqn.params.get("cost_estimate")
            total += float(estimate.flops) if estimate is not None else 0.0
            continue
        subs = [jaxpr_flops(j) for j in _subjaxprs(eqn)]
        if not subs:
            continue
        if name == "scan":
            total += eqn.params["length"] * sum(subs)
        elif name == "cond":
            total += max(subs)
        elif name == "shard_map":
            total += eqn.params["mesh"].size * sum(subs)
        elif name == "while":
            body = eqn.params["body_jaxpr"]
            total += jaxpr_flops(body)
        else:
            total += sum(subs)
    return total
