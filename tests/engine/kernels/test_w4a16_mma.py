"""The hand-placed mma.sync W4A16 kernel (kernels/w4a16_mma.py) against the torch reference.

On the CPU the interpreter runs mma_twin, which rebuilds each warp's A, B and C matrices from the
same per-lane fragments the PTX takes, so these tests check the fragment placement (a lane's
columns, k slots and output rows), the packing order and the group math; on an NVIDIA GPU the
same tests run the mma.sync PTX.

Error bound, per output row relative to the fp64 reference: the activations reach the kernel as
fp16 scaled by a power of two per (row, group) into [1, 2) x 2^14 (exact for bf16 inputs and for
fp16 ones of the same range), the nibbles as exact fp16 subnormals, their products are exact in
the fp32 accumulator, so the only rounding is fp32 accumulation and the group sums (~1e-6 seen):
bound 1e-4 with an fp32 output; 1e-2 (the sweep's) with bf16 output, which adds up to 2^-8 an
element. A wrong lane, k slot, pair order, group or split gives > 0.1.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import w4a16_pack as wp
from homelab_llm.engine.kernels.ref import dequantize_w4_ref

FP32_BOUND, BF16_BOUND = 1e-4, 1e-2

# (M, K, N, tiles (warps_n, warps_k, split), symmetric, x dtype, x scale): M 1..32; N not a
# multiple of the 16-column tile (masked columns, and a tile's second half past N); K in 2-5
# groups over 1-3 program splits and 1-4 warp ranges (uneven: masked groups); x at 3000 (q x would
# overflow fp16 without the pre-scale) and 1e-3; fp16 activations; asymmetric (bias) weights.
CASES = [
    (1, 256, 40, (1, 1, 1), True, torch.bfloat16, 1.0),
    (2, 384, 67, (2, 2, 1), False, torch.bfloat16, 3000.0),
    (3, 640, 24, (1, 4, 2), False, torch.float16, 1.0),
    (5, 256, 64, (2, 1, 2), True, torch.bfloat16, 1e-3),
    (8, 512, 57, (1, 2, 3), False, torch.bfloat16, 1.0),
    (7, 384, 16, (4, 1, 1), False, torch.float16, 1.0),
    (4, 512, 128, (2, 2, 2, 8, 2), False, torch.bfloat16, 1.0),  # two quads a thread, whole tiles
    (6, 384, 100, (1, 1, 1, 8, 2), True, torch.float16, 1.0),  # two quads, the second past N
    # 9-32 rows: two or four row tiles (the last partly past M), over splits and warp ranges;
    # quads 2 asked with 16 or 20 rows runs one quad
    (9, 256, 40, (1, 1, 1), True, torch.float16, 1.0),
    (12, 384, 67, (2, 2, 1), False, torch.bfloat16, 3000.0),
    (16, 640, 57, (1, 2, 3), False, torch.bfloat16, 1.0),
    (16, 256, 40, (1, 1, 1, 8, 2), True, torch.bfloat16, 1e-3),
    (20, 384, 40, (2, 2, 1), False, torch.bfloat16, 3000.0),
    (25, 256, 40, (1, 1, 1), True, torch.float16, 1.0),
    (32, 384, 57, (1, 2, 2), False, torch.bfloat16, 1.0),
    (20, 256, 40, (1, 1, 1, 8, 2), False, torch.bfloat16, 1.0),
]


def _case(m: int, k: int, n: int, symmetric: bool, dtype: torch.dtype, scale: float, device: torch.device):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    w = wp.quantize_rtn(torch.randn(n, k, generator=gen) * 0.05, 128, symmetric).to(device)
    x = (torch.randn(m, k, generator=gen) * scale).to(device, dtype)
    return w, x, x.double() @ dequantize_w4_ref(w).double()


def _row_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want).norm(dim=1) / want.norm(dim=1)).max())


@pytest.mark.parametrize("m,k,n,tiles,symmetric,dtype,scale", CASES)
def test_mma_matches_reference(m: int, k: int, n: int, tiles: tuple, symmetric: bool, dtype: torch.dtype,
                               scale: float, device: torch.device) -> None:
    from homelab_llm.engine.kernels.w4a16_mma import MmaTiles, w4a16_mma

    w, x, want = _case(m, k, n, symmetric, dtype, scale, device)
    t = MmaTiles(*tiles)
    got = w4a16_mma(x, w, torch.empty((m, n), dtype=torch.float32, device=device), t)
    assert _row_rel_err(got, want) < FP32_BOUND, (m, k, n, tiles)
    got = w4a16_mma(x, w, torch.empty((m, n), dtype=torch.bfloat16, device=device), t)
    assert _row_rel_err(got, want) < BF16_BOUND, (m, k, n, tiles)


def test_mma_outliers_and_prepared_pairs(device: torch.device) -> None:
    """Channels near the fp16 limit beside tiny ones (each (row, group) has its own power of two),
    rows 10^6 apart; the pairs prepared once and passed in give the same numbers, twice (the
    split's tickets reset themselves)."""
    from homelab_llm.engine.kernels.w4a16_mma import MmaTiles, prep_pairs, w4a16_mma

    w, x, _ = _case(2, 384, 48, False, torch.bfloat16, 1.0, device)
    x[0, 5], x[0, 130], x[1, 77] = 60000.0, -30000.0, 4e-3
    x[1] *= 1e-3
    want = x.double() @ dequantize_w4_ref(w).double()
    out = torch.empty((2, 48), dtype=torch.float32, device=device)
    t = MmaTiles(1, 2, 2)
    assert torch.isfinite(w4a16_mma(x, w, out, t)).all() and _row_rel_err(out, want) < FP32_BOUND
    pairs = prep_pairs(x, 128)
    for _ in range(2):
        assert _row_rel_err(w4a16_mma(x, w, out, t, pairs=pairs), want) < FP32_BOUND


def test_mma_full_shapes(device: torch.device, full_shapes: bool) -> None:
    """Model shapes on a GPU (Qwen3.6-27B in_proj_qkvz / down / gate_up, Llama-3.1-8B o_proj,
    Qwen3-30B-A3B o_proj / LM head) at 1-32 rows with the tiles mma_tiles picks (each of its
    three kinds; the split from the SM count)."""
    from homelab_llm.engine.kernels.w4a16_mma import w4a16_mma

    if not full_shapes:
        pytest.skip("GPU shapes")
    for m, k, n in ((1, 5120, 16384), (2, 17408, 5120), (8, 4096, 4096), (8, 5120, 34816), (8, 2048, 2048),
                    (3, 2048, 151936), (16, 5120, 16384), (12, 17408, 5120), (32, 5120, 34816),
                    (24, 6144, 5120)):
        w, x, want = _case(m, k, n, False, torch.bfloat16, 1.0, device)
        got = w4a16_mma(x, w, torch.empty((m, n), dtype=torch.bfloat16, device=device))
        assert _row_rel_err(got, want) < BF16_BOUND, (m, k, n)


def test_mma_tiles_by_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """mma_tiles' picks on a 132-SM device (an H100's count): one-warp programs for large
    matrices, four-warp K-splitting programs for wide outputs, the two-by-two programs for LM
    heads and for 12 Mi weights or fewer; at 9+ rows ROWS16 but for heads; HOMELAB_LLM_MMA_TILES fixes every shape's tiles, and a
    wrong field is an error naming the fields."""
    from homelab_llm.engine.kernels import w4a16_mma as mod

    monkeypatch.setattr(mod, "device_sms", lambda device: 132)
    monkeypatch.delenv(mod.MMA_TILES_ENV, raising=False)
    dev = torch.device("cpu")
    shapes = {(5120, 17408): mod.ONE_WARP, (16384, 5120): mod.ONE_WARP, (17408, 5120): mod.ONE_WARP,
              (34816, 5120): mod.K_WARPS, (28672, 4096): mod.K_WARPS, (151936, 2048): mod.SQUARE,
              (64128, 4096): mod.SQUARE, (4096, 4096): mod.ONE_WARP, (5120, 3072): mod.ONE_WARP,
              (5120, 2048): mod.SQUARE, (2048, 4096): mod.SQUARE}
    assert {nk: mod.mma_tiles(*nk, dev) for nk in shapes} == shapes
    # 9+ rows: ROWS16 but for LM heads
    assert [mod.mma_tiles(n, k, dev, 16) for n, k in ((5120, 17408), (5120, 2048), (151936, 2048))] == [
        mod.ROWS16, mod.ROWS16, mod.SQUARE]
    assert mod.mma_tiles(5120, 17408, dev, 8) == mod.ONE_WARP
    assert (mod.ONE_WARP.warps_n * mod.ONE_WARP.warps_k, mod.K_WARPS.warps_k, mod.SQUARE.warps_n) == (1, 4, 2)
    monkeypatch.setenv(mod.MMA_TILES_ENV, "warps_n=2,warps_k=2,waves=8")
    assert mod.mma_tiles(5120, 17408, dev) == mod.MmaTiles(2, 2, 0, 8, 1)
    monkeypatch.setenv(mod.MMA_TILES_ENV, "warps=2")
    with pytest.raises(ValueError, match="warps_k"):
        mod.mma_tiles(5120, 17408, dev)


def test_mma_rejects_what_it_cannot_take(device: torch.device) -> None:
    from homelab_llm.engine.kernels.w4a16_mma import MAX_ROWS, w4a16_mma

    w, x, _ = _case(1, 256, 32, True, torch.bfloat16, 1.0, device)
    x9 = x.expand(MAX_ROWS + 1, -1).contiguous()
    with pytest.raises(ValueError, match="rows"):
        w4a16_mma(x9, w, torch.empty((MAX_ROWS + 1, 32), dtype=torch.float32, device=device))
    w64 = wp.quantize_rtn(torch.randn(32, 256) * 0.05, 64, True).to(device)
    with pytest.raises(ValueError, match="group 128"):
        w4a16_mma(x, w64, torch.empty((1, 32), dtype=torch.float32, device=device))


def test_matmul_routes_rows_to_mma_under_the_switch(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """HOMELAB_LLM_W4A16_MMA=lo-hi sends those rows to the mma kernel on NVIDIA GPUs (the
    interpreter keeps its table), and w4a16_matmul gives the reference either way; a bad value
    is a clear error; "off" takes a table's mma rows back to the packed-half and left-operand
    kernels."""
    from homelab_llm.engine.kernels import tuning
    from homelab_llm.engine.kernels.w4a16 import w4a16_matmul
    from homelab_llm.engine.kernels.w4a16_mma import w4a16_mma as mma

    monkeypatch.setenv(tuning.MMA_ROWS_ENV, "2-8")
    on_gpu = tuning.arch_name(device).startswith("sm")
    assert (tuning.w4a16_route(3, device) == "mma") == on_gpu and tuning.w4a16_route(1, device) != "mma"
    w, x, want = _case(3, 256, 48, False, torch.bfloat16, 1.0, device)
    got = w4a16_matmul(x.view(1, 3, 256), w)
    assert got.shape == (1, 3, 48) and _row_rel_err(got.view(3, 48), want) < BF16_BOUND
    monkeypatch.setenv(tuning.MMA_ROWS_ENV, "8-2")
    with pytest.raises(ValueError, match="lo <= hi"):
        tuning.w4a16_route(3, device)
    # a table that routes 2-8 rows to mma (sm90's): "off" gives them the kernels they took before
    monkeypatch.setitem(tuning.W4A16_ROUTES, tuning.arch_name(device), ((1, "h2"), (8, "mma"), (1 << 62, "deq")))
    monkeypatch.setenv(tuning.MMA_ROWS_ENV, "off")
    assert [tuning.w4a16_route(m, device) for m in (1, 2, 3, 8, 9)] == ["h2", "h2", "dotL", "dotL", "deq"]
    monkeypatch.setenv(tuning.MMA_ROWS_ENV, "")
    assert [tuning.w4a16_route(m, device) for m in (1, 2, 8)] == ["h2", "mma", "mma"]
    # a table that routes up to 16 rows there: 12 rows in one launch (two row tiles)
    monkeypatch.setitem(tuning.W4A16_ROUTES, tuning.arch_name(device), ((1, "h2"), (16, "mma"), (1 << 62, "deq")))
    from homelab_llm.engine.kernels import w4a16 as w4a16_mod

    calls = []
    monkeypatch.setattr(w4a16_mod, "w4a16_mma", lambda x2, *a, **kw: calls.append(x2.shape[0]) or mma(x2, *a, **kw))
    w, x, want = _case(12, 256, 48, True, torch.bfloat16, 1.0, device)
    got = w4a16_matmul(x.view(2, 6, 256), w)
    assert calls == [12] and _row_rel_err(got.view(12, 48), want) < BF16_BOUND


@pytest.mark.parametrize("m,residual,keep", [(3, True, True), (8, False, False), (2, True, False)])
def test_prep_forms_the_norm(m: int, residual: bool, keep: bool, device: torch.device) -> None:
    """prep_pairs with the RMSNorm prologue (one launch instead of the norm's and the prep's)
    against the separate norm kernel then the pairs of its rows: the same values up to the sum
    of squares' order (a rounding of rsqrt: bound 1e-3 a row); summed is x + residual exactly,
    normed the separate kernel's rows within an ulp of bf16."""
    from homelab_llm.engine.kernels import elementwise
    from homelab_llm.engine.kernels.w4a16_mma import prep_pairs, w4a16_mma

    k, n = 640, 48
    w, x, _ = _case(m, k, n, False, torch.bfloat16, 1.0, device)
    gen = torch.Generator().manual_seed(m + 5)
    res = torch.randn(m, k, generator=gen).to(device, torch.bfloat16) if residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(device, torch.bfloat16)
    if residual:
        want_normed, want_sum = elementwise.add_rms_norm(x, res, nw, 1e-6)
    else:
        want_normed = elementwise.rms_norm(x, nw, 1e-6)
    summed = torch.full_like(x, float("nan")) if residual else None
    normed = torch.full_like(x, float("nan")) if keep else None
    xh, xg = prep_pairs(x, 128, norm_weight=nw, eps=1e-6, residual=res, summed=summed, normed=normed)
    got = w4a16_mma(xh, w, torch.empty((m, n), dtype=torch.float32, device=device), pairs=(xh, xg))
    separate = w4a16_mma(want_normed, w, torch.empty((m, n), dtype=torch.float32, device=device))
    assert _row_rel_err(got, separate.double()) < 1e-3
    assert _row_rel_err(got, want_normed.double() @ dequantize_w4_ref(w).double()) < 1e-3
    if residual:
        assert torch.equal(summed, want_sum)
    if keep:
        torch.testing.assert_close(normed, want_normed, rtol=2 ** -7, atol=0)


def test_prep_forms_the_gated_activation(device: torch.device) -> None:
    """prep_pairs with act_in: x2 is gate | up [M, 2K], the pairs SiLU(gate) * up, against the
    separate SiLU-and-mul kernel's rows (bound 1e-3 a row: the interpreter's casts truncate
    where torch rounds)."""
    from homelab_llm.engine.kernels import elementwise
    from homelab_llm.engine.kernels.w4a16_mma import prep_pairs, w4a16_mma

    m, k, n = 4, 384, 40
    w, _, _ = _case(m, k, n, True, torch.bfloat16, 1.0, device)
    gu = torch.randn(m, 2 * k, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
    act = elementwise.silu_and_mul(gu)
    xh, xg = prep_pairs(gu, 128, act_in="silu")
    got = w4a16_mma(xh, w, torch.empty((m, n), dtype=torch.float32, device=device), pairs=(xh, xg))
    assert _row_rel_err(got, act.double() @ dequantize_w4_ref(w).double()) < 1e-3
    with pytest.raises(ValueError, match="act_in"):
        prep_pairs(gu, 128, act_in="relu")


def test_dispatch_norm_and_act_on_the_mma_route(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """With HOMELAB_LLM_W4A16_MMA on a GPU the layers' norm-then-linear and act-then-linear take
    the mma kernel with the input formed in the pairs' launch (elsewhere the other routes): the
    results match the separate ops' within 1e-2 a row (bf16 outputs), summed within an ulp."""
    from homelab_llm.engine.kernels import dispatch, elementwise, tuning

    monkeypatch.setenv(tuning.MMA_ROWS_ENV, "2-8")
    m, k, n = 4, 512, 64
    w, x, _ = _case(m, k, n, False, torch.bfloat16, 1.0, device)
    gen = torch.Generator().manual_seed(11)
    res = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(device, torch.bfloat16)
    assert dispatch.w4a16_mma_route(x, w) == tuning.arch_name(device).startswith("sm")
    normed, want_sum = elementwise.add_rms_norm(x, res, nw, 1e-6)
    out, summed = dispatch.w4a16_norm_matmul(x, res, nw, 1e-6, w)
    # (the CPU path adds in torch, which rounds where the interpreter's kernel truncates)
    torch.testing.assert_close(summed, want_sum, rtol=2 ** -7, atol=0)
    assert _row_rel_err(out, normed.double() @ dequantize_w4_ref(w).double()) < BF16_BOUND
    gu = torch.randn(m, 2 * k, generator=gen).to(device, torch.bfloat16)
    act = elementwise.silu_and_mul(gu)
    out = dispatch.w4a16_act_matmul(gu, w)
    assert _row_rel_err(out, act.double() @ dequantize_w4_ref(w).double()) < BF16_BOUND
