"""Checks shared by the few-row W4A16 kernel tests (the GEMV and the tensor-core few-row kernel)."""

from __future__ import annotations

import torch

from homelab_llm.engine.kernels import w4a16_pack as wp
from homelab_llm.engine.kernels.ref import dequantize_w4_ref


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def check_few_row_kernel(kernel, shapes, splits, gen, group_size: int, device: torch.device) -> None:
    """kernel(x, w, out, split=...) against the dequantized reference, row by row (bound 1e-2
    relative per row), symmetric and with zero points, each split count twice in a row: the
    per-tile tickets must reset, and the two results be bit-identical."""
    for m, k, n in shapes:
        for symmetric in (True, False):
            w = wp.quantize_rtn((torch.randn(n, k, generator=gen) * 0.05).to(device), group_size, symmetric)
            x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
            want = x.float() @ dequantize_w4_ref(w)
            for split in splits:
                out = torch.empty((m, n), dtype=torch.bfloat16, device=device)
                first = kernel(x, w, out, split=split).clone()
                second = kernel(x, w, out, split=split)
                for row in range(m):
                    assert rel_err(first[row], want[row]) < 1e-2, (m, k, n, split, row)
                assert torch.equal(first, second), (m, k, n, split)
