"""The interpreter's table patched to route 3-16 rows to the few-row W4A16 left-operand kernel
(kernels/w4a16_dot.py), for tests that run the GPU path on CPU tensors through the interpreter."""

from __future__ import annotations

import dataclasses
import os

import pytest

from homelab_llm.engine.kernels import tuning

# the layer tests run the GPU path on CPU tensors through the interpreter, on its patched table
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the GPU path through the Triton interpreter (CPU only)")


def use_left_table(monkeypatch, x_pairs: bool) -> None:
    """The interpreter's table routing 3-16 rows to the left-operand kernel on 16 x 64 tiles
    in the integer-zero form, reading x in pair order or not."""
    tiles = tuning.GemmTiles(16, 64, 128, num_warps=4, num_stages=2, split_k=4, int_zeros=True,
                             x_pairs=x_pairs)
    monkeypatch.setitem(tuning.W4A16_ROUTES, "interpret", ((2, "h2"), (16, "dotL"), (1 << 62, "deq")))
    monkeypatch.setitem(tuning.TABLE, "interpret", dataclasses.replace(
        tuning.TABLE["interpret"], w4a16_dot_left=((16, tiles),), w4a16_dot_left_thin=()))
