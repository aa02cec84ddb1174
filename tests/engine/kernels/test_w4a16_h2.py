"""The packed-half W4A16 GEMV (kernels/w4a16_h2.py) against the dequantized torch reference.

On the CPU the interpreter runs the kernel's plain-Triton fp16 twin of the PTX (same packing
order, pre-scale and group math); on an NVIDIA GPU the same tests run the fma.rn.f16x2 PTX.

Error bound, per output row relative to the fp64 reference: products and partial sums are fp16
(2^-11 relative rounding) over at most one K step, then fp32; with activations pre-scaled per
step into (-2, 2) a row's error is ~sqrt(terms per step) * 2^-11 of the step sums, ~2e-3 seen at
these shapes. Bounds: 5e-3 with an fp32 output, 1e-2 (the sweep's bound) with bf16 output
(which adds up to 2^-8 per element). A wrong nibble, pair order, group or split gives > 0.1.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels import w4a16_pack as wp
from homelab_llm.engine.kernels.ref import dequantize_w4_ref
from homelab_llm.engine.kernels.tuning import RowsTiles
from homelab_llm.engine.kernels.w4a16_half2 import half_hi, half_lo, hfma2, nibble_pairs

FP32_BOUND, BF16_BOUND = 5e-3, 1e-2

# (M, K, N, group, split, symmetric, x dtype, x scale): M 1..8 (3, 5: padded BLOCK_M); odd N
# (partial column block); K over 3 or 5 splits (uneven last split); groups 32/64/128 (32: the
# K step shrinks to the group); split None: the table's; x scaled to 3000 (q x overflows fp16
# without the pre-scale) and 1e-3; fp16 activations.
CASES = [
    (1, 256, 96, 128, None, True, torch.bfloat16, 1.0),
    (1, 384, 67, 64, 5, False, torch.float16, 1.0),
    (2, 384, 67, 128, 3, False, torch.bfloat16, 3000.0),
    (3, 256, 40, 64, 1, True, torch.bfloat16, 1e-3),
    (5, 128, 64, 32, None, False, torch.float16, 1.0),
    (8, 256, 33, 128, 2, True, torch.bfloat16, 1.0),
]


def _case(m: int, k: int, n: int, group: int, symmetric: bool, dtype: torch.dtype, scale: float,
          device: torch.device):
    gen = torch.Generator().manual_seed(m * 1000 + k + n + group)
    w = wp.quantize_rtn(torch.randn(n, k, generator=gen) * 0.05, group, symmetric).to(device)
    x = (torch.randn(m, k, generator=gen) * scale).to(device, dtype)
    want = x.double() @ dequantize_w4_ref(w).double()
    return w, x, want


def _row_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want).norm(dim=1) / want.norm(dim=1)).max())


@pytest.mark.parametrize("m,k,n,group,split,symmetric,dtype,scale", CASES)
def test_h2_matches_reference(m: int, k: int, n: int, group: int, split: int | None, symmetric: bool,
                              dtype: torch.dtype, scale: float, device: torch.device) -> None:
    from homelab_llm.engine.kernels.w4a16_h2 import w4a16_h2

    w, x, want = _case(m, k, n, group, symmetric, dtype, scale, device)
    got = w4a16_h2(x, w, torch.empty((m, n), dtype=torch.float32, device=device), split=split)
    assert _row_rel_err(got, want) < FP32_BOUND, (m, k, n, group, split)
    got = w4a16_h2(x, w, torch.empty((m, n), dtype=torch.bfloat16, device=device), split=split)
    assert _row_rel_err(got, want) < BF16_BOUND, (m, k, n, group, split)


def test_h2_outlier_channels_do_not_overflow(device: torch.device) -> None:
    """A few channels near the fp16 limit (massive activations) beside ordinary ones: each
    K step is scaled by its own power of two, so neither overflow nor the small channels' loss
    shows. Rows differ in magnitude by 10^6 (the scale is per row too)."""
    from homelab_llm.engine.kernels.w4a16_h2 import w4a16_h2

    w, x, _ = _case(2, 256, 48, 64, False, torch.bfloat16, 1.0, device)
    x[0, 5], x[0, 130], x[1, 77] = 60000.0, -30000.0, 4e-3
    x[1] *= 1e-3
    want = x.double() @ dequantize_w4_ref(w).double()
    got = w4a16_h2(x, w, torch.empty((2, 48), dtype=torch.float32, device=device), split=2)
    assert torch.isfinite(got).all() and _row_rel_err(got, want) < FP32_BOUND


def test_h2_tile_variants_and_repeat(device: torch.device) -> None:
    """Explicit tiles (what the sweep passes) give the same numbers, with and without the
    next-step prefetch (splits of 1 and 2 steps: the last step re-requests itself), the L2
    prefetch of the first step (a GPU's: a no-op in the interpreter) and a split streaming
    several steps through a deeper pipeline, and a second call with the
    same split (the tickets must have reset themselves) too."""
    from homelab_llm.engine.kernels.w4a16_h2 import w4a16_h2

    w, x, want = _case(4, 256, 80, 128, False, torch.bfloat16, 1.0, device)
    out = torch.empty((4, 80), dtype=torch.float32, device=device)
    for tiles, repeats in ((RowsTiles(64, 8, 1, waves=8, min_steps=1), 2), (RowsTiles(16, 16, 1), 1),
                           (RowsTiles(32, 4, 1, prefetch=True), 1), (RowsTiles(64, 16, 1, prefetch=True), 1),
                           (RowsTiles(16, 16, 1, num_stages=2, prefetch_l2=True), 1),
                           (RowsTiles(64, 8, 1, prefetch_l2=True), 2),
                           # streaming: 4 K steps a split through 4 shared-memory stages
                           (RowsTiles(16, 4, 1, num_stages=4, waves=1, min_steps=4), 2)):
        for _ in range(repeats):
            assert _row_rel_err(w4a16_h2(x, w, out, tiles, split=2), want) < FP32_BOUND, tiles


def test_h2_full_shapes(device: torch.device, full_shapes: bool) -> None:
    """Model shapes on a GPU (8B qkv / down / gate_up / o_proj, 27B gate_up at 5 rows): long K,
    many splits, and at 1 row sm_90's streaming tiles (wide and thin)."""
    from homelab_llm.engine.kernels.w4a16_h2 import w4a16_h2

    if not full_shapes:
        pytest.skip("GPU shapes")
    for m, k, n in ((1, 4096, 6144), (1, 4096, 28672), (1, 14336, 4096), (2, 14336, 4096),
                    (5, 5120, 34816), (8, 4096, 1000)):
        w, x, want = _case(m, k, n, 128, False, torch.bfloat16, 1.0, device)
        got = w4a16_h2(x, w, torch.empty((m, n), dtype=torch.bfloat16, device=device))
        assert _row_rel_err(got, want) < BF16_BOUND, (m, k, n)


def test_h2_rejects_too_many_rows(device: torch.device) -> None:
    from homelab_llm.engine.kernels.w4a16_h2 import MAX_ROWS, w4a16_h2

    w, x, _ = _case(1, 128, 32, 128, True, torch.bfloat16, 1.0, device)
    x = x.expand(MAX_ROWS + 1, -1).contiguous()
    with pytest.raises(ValueError, match="rows"):
        w4a16_h2(x, w, torch.empty((MAX_ROWS + 1, 32), dtype=torch.float32, device=device))


def test_matmul_routes_decode_rows_to_h2_in_the_interpreter(device: torch.device) -> None:
    from homelab_llm.engine.kernels import tuning
    from homelab_llm.engine.kernels.w4a16 import w4a16_matmul

    if tuning.arch_name(device) == "interpret":
        assert tuning.w4a16_route(1) == "h2" and tuning.w4a16_route(2) == "h2"
    w, x, want = _case(2, 256, 48, 64, False, torch.bfloat16, 1.0, device)
    got = w4a16_matmul(x.view(1, 2, 256), w)
    assert got.shape == (1, 2, 48) and _row_rel_err(got.view(2, 48), want) < BF16_BOUND


@triton.jit
def _pairs_probe(words_ptr, out_ptr, a_ptr, b_ptr, c_ptr, fma_ptr, N: tl.constexpr, USE_ASM: tl.constexpr):
    offs = tl.arange(0, N)
    pairs = nibble_pairs(tl.load(words_ptr + offs))
    for j in tl.static_range(4):
        p = pairs[j]
        tl.store(out_ptr + (2 * j) * N + offs, half_lo(p).to(tl.float32))
        tl.store(out_ptr + (2 * j + 1) * N + offs, half_hi(p).to(tl.float32))
    if USE_ASM:
        tl.store(fma_ptr + offs, hfma2(tl.load(a_ptr + offs), tl.load(b_ptr + offs), tl.load(c_ptr + offs)))


def test_nibble_pairs_are_exact_subnormals(device: torch.device) -> None:
    """Pair j of a word is (q_j, q_j+4) * 2^-24 (even j) or 2^-20 (odd j), exactly -- what the
    activations' 2^14 / 2^10 pre-scale assumes; on NVIDIA also one fma.rn.f16x2 against torch
    (exact product, one rounding: within 1 ulp of torch's fp32-then-fp16)."""
    n = 256
    gen = torch.Generator().manual_seed(7)
    q = torch.randint(0, 16, (8, n), generator=gen, dtype=torch.int64)
    words = sum(q[j] << (4 * j) for j in range(8))
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).to(device)
    halves = torch.randn(3, n, 2, generator=gen).to(torch.float16) * 4
    a, b, c = (h.contiguous().view(torch.int32).view(n).to(device) for h in halves)
    out = torch.empty((8, n), dtype=torch.float32, device=device)
    fma = torch.zeros(n, dtype=torch.int32, device=device)
    use_asm = device.type == "cuda" and torch.version.hip is None
    _pairs_probe[(1,)](words, out, a, b, c, fma, N=n, USE_ASM=use_asm)
    for j in range(4):
        unit = 2.0 ** (-24 if j % 2 == 0 else -20)
        assert torch.equal(out[2 * j].cpu(), q[j].float() * unit), j
        assert torch.equal(out[2 * j + 1].cpu(), q[j + 4].float() * unit), j
    if use_asm:
        want = (halves[0].float() * halves[1].float() + halves[2].float()).half().view(n * 2).float()
        got = fma.cpu().view(torch.float16).float()
        assert ((got - want).abs() <= want.abs() * 2.0 ** -10 + 2.0 ** -24).all()


def test_h2_thin_outputs_take_their_entry(device: torch.device, monkeypatch) -> None:
    """Outputs of at most THIN_N columns take the arch's thin entry for their row count (sm_90: 2
    rows, narrower column blocks); wider outputs and other row counts keep w4a16_h2's; a launch
    through the thin entry still matches the reference."""
    import dataclasses

    from homelab_llm.engine.kernels import tuning
    from homelab_llm.engine.kernels.w4a16_h2 import w4a16_h2

    sm90 = tuning.TABLE["sm90"]
    assert any(lo <= 2 <= hi for lo, hi, _ in sm90.w4a16_h2_thin)
    thin = RowsTiles(16, 4, 1, num_stages=3, waves=8, min_steps=1)
    arch = tuning.tiles_for(device)
    monkeypatch.setitem(tuning.TABLE, arch.name, dataclasses.replace(arch, w4a16_h2_thin=((2, 3, thin),)))
    assert tuning.h2_tiles(2, device, tuning.THIN_N) is thin and tuning.h2_tiles(3, device, 80) is thin
    assert tuning.h2_tiles(2, device, tuning.THIN_N + 1) is not thin
    assert tuning.h2_tiles(1, device, 80) is not thin and tuning.h2_tiles(2, device) is not thin
    w, x, want = _case(2, 256, 80, 128, False, torch.bfloat16, 1.0, device)
    got = w4a16_h2(x, w, torch.empty((2, 80), dtype=torch.float32, device=device))
    assert _row_rel_err(got, want) < FP32_BOUND
