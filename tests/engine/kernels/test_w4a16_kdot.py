"""The K-major one-dot few-row W4A16 kernel (w4a16_kdot.py) against the dequantized reference."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import w4a16_pack as wp
from homelab_llm.engine.kernels.ref import dequantize_w4_ref
from homelab_llm.engine.kernels.tuning import GemmTiles
from tests.engine.kernels.w4a16_checks import check_few_row_kernel


@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("group_size", [32, 128])
def test_kdot_rows_groups_splits(swap: bool, group_size: int, device: torch.device, full_shapes: bool) -> None:
    """1-64 rows, N not a multiple of the column block, symmetric and with zero points, every
    split count twice in a row (tickets reset: bit-identical), both operand orders; per-row
    bound 1e-2 (bf16 output rounding is ~4e-3)."""
    from homelab_llm.engine.kernels.w4a16_kdot import w4a16_kdot

    gen = torch.Generator().manual_seed(41 + group_size + swap)
    shapes = [(1, 5120, 6144), (5, 17408, 5120), (33, 5120, 1000), (64, 6144, 2560)] if full_shapes \
        else [(1, 384, 40), (5, 128, 96), (17, 256, 72)]

    def kernel(x, w, out, split=None):
        return w4a16_kdot(x, w, out, split=split, swap=swap)

    check_few_row_kernel(kernel, shapes, (1, 2, 3), gen, group_size, device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kdot_magic_number_nibbles_and_slot_order(dtype: torch.dtype, device: torch.device) -> None:
    """Every nibble position reaches its own k: one-hot activations pick single weight rows, so a
    slot-order mistake (x gathered in another order than the tile's columns) shows as a wrong
    row. fp32 output against fp64: the OFFSET subtraction costs ~7 (bf16) / ~10 (fp16) bits of
    fp32's 24, so 2e-4 of each row's norm bounds it."""
    from homelab_llm.engine.kernels.w4a16_kdot import w4a16_kdot

    gen = torch.Generator().manual_seed(43)
    k, n = 128, 32
    w = wp.quantize_rtn(torch.randn(n, k, generator=gen) * 0.05, 128, False).to(device)
    ref = dequantize_w4_ref(w).double()
    eye = torch.eye(k, device=device)[:16 * 8:8 + 1]  # k = 0, 9, 18, ...: every nibble slot
    for rows in (eye, torch.randn(3, k, generator=gen).to(device)):
        x = rows.to(dtype)
        tiles = GemmTiles(16, 32, 128, num_warps=1, num_stages=1, split_k=1)
        got = w4a16_kdot(x, w, torch.empty((x.shape[0], n), dtype=torch.float32, device=device), tiles, split=1)
        want = x.double() @ ref
        assert float(((got.double() - want).norm(dim=1) / want.norm(dim=1)).max()) < 2e-4, dtype
