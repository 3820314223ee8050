"""Lowering for an accelerator platform on a CPU: inside ``lowering(platform)``, ``jax.jit(f).trace(...).lower(
lowering_platforms=(platform,))`` of a program that names no mesh lowers for one compile-only device of that platform
(:func:`lpt.targets.lowering_for`): jax >= 0.12's Pallas Triton lowering needs to know the GPU it compiles for."""

from lpt import targets

TOPOLOGY = {"cuda": "h100:1x1x1", "tpu": "v5e:2x2"}


def lowering(platform: str):
    return targets.lowering_for(TOPOLOGY[platform])
