"""The multi-row W4A16 GEMV (kernels/w4a16_rows.py) against the dequantized torch reference."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import w4a16_pack as wp
from homelab_llm.engine.kernels.ref import dequantize_w4_ref
from homelab_llm.engine.kernels.tuning import RowsTiles

# (M, K, N, group, split, symmetric): M 1, 2, 3, 8, 16 (3: BLOCK_M 4 with a masked row); odd N
# (a partial column block, unaligned rows); K 384 over 5 splits (96 each: the last is shorter;
# and 5 becomes 4 splits); groups 32/64/128 (32: the step shrinks to the group); split None:
# the table's choice.
CASES = [
    (1, 256, 96, 128, None, True),
    (2, 384, 67, 128, 5, False),
    (3, 256, 67, 64, 3, True),
    (8, 384, 40, 128, 2, False),
    (8, 128, 64, 32, None, False),
    (16, 256, 33, 128, 1, True),
]


def _case(m: int, k: int, n: int, group: int, symmetric: bool, device: torch.device):
    gen = torch.Generator().manual_seed(m * 1000 + k + n + group)
    w = wp.quantize_rtn(torch.randn(n, k, generator=gen) * 0.05, group, symmetric).to(device)
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    want = x.double() @ dequantize_w4_ref(w).double()
    return w, x, want


def _row_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want).norm(dim=1) / want.norm(dim=1)).max())


@pytest.mark.parametrize("m,k,n,group,split,symmetric", CASES)
def test_rows_matches_reference(m: int, k: int, n: int, group: int, split: int | None,
                                symmetric: bool, device: torch.device) -> None:
    from homelab_llm.engine.kernels.w4a16_rows import w4a16_rows

    w, x, want = _case(m, k, n, group, symmetric, device)
    # fp32 output: only fp32 summation order differs from the fp64 reference; 1e-5 of each row's
    # norm is ~100x that rounding at these K, and a wrong nibble, group or split shows as >1e-2.
    got = w4a16_rows(x, w, torch.empty((m, n), dtype=torch.float32, device=device), split=split)
    assert _row_rel_err(got, want) < 1e-5, (m, k, n, group, split)
    # bf16 output (what the engine stores): 8 significant bits, <= 2^-7 = 7.8e-3 per element even
    # where the cast truncates (the interpreter's may).
    got = w4a16_rows(x, w, torch.empty((m, n), dtype=torch.bfloat16, device=device), split=split)
    assert _row_rel_err(got, want) < 8e-3, (m, k, n, group, split)


def test_rows_tile_variants_and_repeat(device: torch.device) -> None:
    """Explicit tiles (what the sweep passes) give the same numbers, and a second call with the
    same split (the tickets must have reset themselves) too."""
    from homelab_llm.engine.kernels.w4a16_rows import w4a16_rows

    w, x, want = _case(4, 256, 80, 128, False, device)
    out = torch.empty((4, 80), dtype=torch.float32, device=device)
    for tiles, repeats in ((RowsTiles(64, 8, 1, waves=8, min_steps=1), 2), (RowsTiles(16, 16, 1), 1)):
        for _ in range(repeats):
            assert _row_rel_err(w4a16_rows(x, w, out, tiles, split=2), want) < 1e-5, tiles


def test_rows_rejects_too_many_rows(device: torch.device) -> None:
    from homelab_llm.engine.kernels.w4a16_rows import MAX_ROWS, w4a16_rows

    w, x, _ = _case(1, 128, 32, 128, True, device)
    x = x.expand(MAX_ROWS + 1, -1).contiguous()
    with pytest.raises(ValueError, match="rows"):
        w4a16_rows(x, w, torch.empty((MAX_ROWS + 1, 32), dtype=torch.float32, device=device))


def test_matmul_routes_few_rows_to_the_rows_kernel(device: torch.device) -> None:
    from homelab_llm.engine.kernels import tuning
    from homelab_llm.engine.kernels.w4a16 import w4a16_matmul

    arch = tuning.arch_name(device)
    saved = tuning.W4A16_ROUTES[arch]
    tuning.W4A16_ROUTES[arch] = ((2, "rows"),) + saved  # no arch routes here by default any more
    try:
        assert tuning.w4a16_route(2, device) == "rows"
        w, x, want = _case(2, 256, 48, 64, False, device)
        got = w4a16_matmul(x.view(1, 2, 256), w)
    finally:
        tuning.W4A16_ROUTES[arch] = saved
    assert got.shape == (1, 2, 48) and _row_rel_err(got.view(2, 48), want) < 8e-3
