"""Layer details the model-level parity tests do not isolate."""

from __future__ import annotations

import torch

from homelab_llm.engine.layers.rotary import RopeTables, RotaryEmbedding, rotate_qk


def test_kernel_rope_path_reads_our_table_as_we_do():
    """On a GPU each layer calls dispatch.apply_rope (in place) with the [pos, cos | sin] table;
    on the CPU that call runs its torch reference, which must agree with our 3-op rotation."""
    torch.manual_seed(0)
    rotary = RotaryEmbedding(32, 64, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 16})
    positions = torch.tensor([0, 5, 17, 63])
    qk = torch.randn(4, 6, 32)
    ours = rotate_qk(qk.clone(), 4, rotary.lookup(positions, torch.float32))
    kernel_path = RopeTables(positions, rotary.cos_sin, None, None)
    theirs = rotate_qk(qk.clone(), 4, kernel_path)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert not torch.allclose(ours, qk)  # it did rotate
