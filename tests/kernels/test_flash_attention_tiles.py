"""Tiles per mode: the interpreter keeps the caller's blocks; Mosaic takes the largest multiple dividing T up to 512
(256 for D > 128); Triton goes by the bytes of a row of q: 128 up to 128 bytes, 64 up to 256, else 32. The compile
tests prove them legal for v5e and H100."""

import pytest
from test_flash_attention_kernel import BK, BQ, HKV, B, D, H, T, _inputs  # noqa: F401

from lpt.kernels.flash_attention.options import FlashOptions


def test_tiles_per_mode():
    from lpt.kernels.flash_attention.tiles import tiles

    assert tiles("interpret", 64, 64, 16, 16, 8) == (16, 8)
    assert tiles("mosaic", 32768, 32768, 128, 128, 128) == (512, 512)
    assert tiles("mosaic", 32768, 32768, 256, 128, 128) == (256, 256)
    assert tiles("mosaic", 384, 384, 128, 128, 128) == (384, 384)  # a multiple of 128 dividing T
    assert tiles("mosaic", 32, 32, 128, 8, 8) == (32, 32)  # T itself is always a legal TPU block
    assert tiles("triton", 32768, 32768, 128, 128, 128) == (64, 64)
    assert tiles("triton", 32768, 32768, 64, 128, 128) == (128, 128)
    assert tiles("triton", 32768, 32768, 64, 128, 128, itemsize=4) == (64, 64)  # f32 rows are twice as long
    assert tiles("triton", 32768, 32768, 128, 128, 128, itemsize=4) == (32, 32)
    with pytest.raises(ValueError, match="structure"):
        FlashOptions(causal=True, scale=1.0, block_q=8, block_k=8, interpret=True, structure="ring")
