"""Fused MoE kernels (moe_align, grouped gate_up/down GEMMs, combine) vs the torch references in
kernels/moe_ref.py, on fresh random inputs.

Error bounds: moe_align is exact (same slots in the same order). fp32 experts: 1e-4 relative
Frobenius error (observed ~1e-7; a wrong row, expert or weight is O(1)). bf16 experts: 2e-2
relative (both sides round gate_up and the activation to bf16 at different points). W4A16
experts: 1e-4 relative on fp32 activations (same dequantized weights on both sides).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from homelab_llm.engine.kernels.moe_ref import (
    MoeW4,
    moe_align_ref,
    moe_combine_ref,
    moe_experts_ref,
    route_topk_ref,
)
from tests.engine.kernels.moe_inputs import random_moe_w4, rel_err


def _picks(gen, tokens, experts, top_k, device):
    logits = torch.randn(tokens, experts, generator=gen).to(device)
    return route_topk_ref(logits, top_k, renormalize=True)


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [
    (1, 8, 2, 16), (40, 16, 4, 16), (3, 40, 8, 16), (70, 24, 4, 32),
    (9, 130, 8, 16)])  # 256-wide expert tiles: 32-slot steps, three of them
def test_align_matches_reference(tokens, experts, top_k, block_m, device):
    from homelab_llm.engine.kernels.moe_align import moe_align

    gen = torch.Generator().manual_seed(tokens * experts)
    _, ids = _picks(gen, tokens, experts, top_k, device)
    got = moe_align(ids, experts, block_m)
    want = moe_align_ref(ids, experts, block_m)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())


@pytest.mark.parametrize("tokens,experts,top_k,block_m,one_launch_max", [
    (300, 40, 8, 16, 256), (9, 5, 2, 16, 0), (33, 128, 8, 64, 0), (200, 24, 4, 32, 256),
    (64, 300, 6, 16, 0)])
def test_chunked_align_matches_reference(tokens, experts, top_k, block_m, one_launch_max, device,
                                         monkeypatch):
    """The two-launch path (count, scatter over chunks of slots) gives the reference's exact
    order, also for a few slots over many chunks and for E not a power of two."""
    from homelab_llm.engine.kernels import moe_align as align

    monkeypatch.setattr(align, "ONE_LAUNCH_MAX_SLOTS", one_launch_max)
    gen = torch.Generator().manual_seed(tokens + experts)
    _, ids = _picks(gen, tokens, experts, top_k, device)
    if tokens == 200:  # a hot expert: runs of many blocks
        ids[:150, 0] = 3
    got = align.moe_align(ids, experts, block_m)
    want = moe_align_ref(ids, experts, block_m)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())


def _experts(gen, e, h, i, dtype, device):
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(dtype).to(device)
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(dtype).to(device)
    return w13, w2


def _fp32_bound(bound: float, device) -> float:
    """On a GPU tl.dot takes fp32 operands as TF32 (10-bit mantissa, 2^-11 relative a product):
    ~7e-4 relative at full shapes through the decode kernels (fp32 FMAs) and 2.3e-3 at 37 tokens
    through the two chained grouped GEMMs (H200), so fp32 gets 4e-3 there; the interpreter
    multiplies in fp32."""
    return max(bound, 4e-3) if torch.device(device).type == "cuda" else bound


@pytest.mark.parametrize("tokens", [1, 8, 37])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_fused_moe_matches_reference(tokens, dtype, bound, device, full_shapes):
    from homelab_llm.engine.kernels.fused_moe import fused_moe

    e, h, i, top_k = (128, 2048, 768, 8) if full_shapes else (16, 64, 48, 4)
    gen = torch.Generator().manual_seed(tokens)
    w13, w2 = _experts(gen, e, h, i, dtype, device)
    x = torch.randn(tokens, h, generator=gen).to(dtype).to(device)
    weights, ids = _picks(gen, tokens, e, top_k, device)
    got = fused_moe(x, w13, w2, weights, ids)
    want = moe_experts_ref(x, w13, w2, weights, ids)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert rel_err(got, want) < _fp32_bound(bound, device), rel_err(got, want)


@pytest.mark.parametrize("tokens", [1, 21, 300, 2048])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_moe_w4a16_matches_reference(tokens, dtype, device, full_shapes):
    """4-bit experts against the dequantized reference, fp32 / bf16 / fp16 activations, decode and
    prefill sizes through the grouped GEMM. Bounds: fp32 1e-4 in the interpreter; bf16 1.5e-2
    and fp16 2e-3: the intermediate activation and the output round to 16 bits (measured 8.9e-3
    / 3.6e-4); 2e-2 at full shapes on a GPU (TF32 for fp32)."""
    from homelab_llm.engine.kernels.fused_moe import fused_moe

    if tokens == 300 and not full_shapes and dtype != torch.bfloat16:
        pytest.skip("one prefill-sized case per run in the interpreter")
    if tokens == 2048 and not (full_shapes and dtype == torch.bfloat16):
        pytest.skip("the GPU's prefill tiles (moe_w4_gemm at 128 rows an expert): bf16 on a GPU")
    e, h, i, top_k, g = (128, 2048, 768, 8, 128) if full_shapes else (8, 64, 64, 2, 32)
    gen = torch.Generator().manual_seed(100 + tokens)
    w4 = MoeW4(random_moe_w4(gen, e, h, 2 * i, g, device), random_moe_w4(gen, e, i, h, g, device))
    x = (torch.randn(tokens, h, generator=gen) * 0.1).to(dtype).to(device)
    weights, ids = _picks(gen, tokens, e, top_k, device)
    got = fused_moe(x, w4, None, weights, ids, decode="gemm")
    want = moe_experts_ref(x.float(), w4, None, weights, ids)
    bound = 2e-2 if full_shapes else {torch.float32: 1e-4, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}[dtype]
    assert rel_err(got, want) < bound, rel_err(got, want)


def test_prefill_takes_the_arch_moe_gemm_tiles(device, monkeypatch):
    """Where an arch has moe_w4_gemm / moe_gemm, 4-bit / dense experts at prefill sizes run on
    them (MXFP4 experts and small batches keep the gemm / small entries for both GEMMs), and the
    results still match the reference."""
    from homelab_llm.engine.kernels import tuning
    from homelab_llm.engine.kernels.fused_moe import fused_moe, moe_tiles
    from homelab_llm.engine.kernels.tuning import MoeGemmTiles

    arch = tuning.arch_name(torch.device(device))
    base = tuning.TABLE[arch]
    wide = dataclasses.replace(base.gemm, block_n=base.gemm.block_n * 2)
    dense = MoeGemmTiles(base.gemm, wide, paired=True)
    four_bit = MoeGemmTiles(wide, base.gemm)
    monkeypatch.setitem(tuning.TABLE, arch, dataclasses.replace(base, moe_w4_gemm=four_bit, moe_gemm=dense))
    dev = torch.device(device)
    assert moe_tiles(8 * 100, 8, dev, "w4") == four_bit
    assert moe_tiles(8 * 100, 8, dev) == dense
    assert moe_tiles(8 * 100, 8, dev, "mx4") == MoeGemmTiles(base.gemm, base.gemm)
    assert moe_tiles(8 * 2, 8, dev, "w4") == MoeGemmTiles(base.gemv, base.gemv)
    assert moe_tiles(8 * 2, 8, dev) == MoeGemmTiles(base.gemv, base.gemv)
    # fp32 in the interpreter; bf16 on a GPU, where fp32 tiles of the prefill sizes exceed
    # shared memory (4 bytes an operand)
    dtype, bound = (torch.bfloat16, 2e-2) if dev.type == "cuda" else (torch.float32, 1e-4)
    gen = torch.Generator().manual_seed(9)
    e, h, i, top_k, g = 4, 64, 64, 2, 32
    w4 = MoeW4(random_moe_w4(gen, e, h, 2 * i, g, device), random_moe_w4(gen, e, i, h, g, device))
    w13, w2 = _experts(gen, e, h, i, dtype, device)
    x = (torch.randn(160, h, generator=gen) * 0.1).to(dtype).to(device)
    weights, ids = _picks(gen, 160, e, top_k, device)
    for up, down in ((w4, None), (w13, w2)):
        got = fused_moe(x, up, down, weights, ids)
        want = moe_experts_ref(x.float() if down is None else x, up, down, weights, ids)
        assert rel_err(got, want) < bound, rel_err(got, want)


def test_paired_gate_up_matches_two_dots(device):
    """Gate and up interleaved in one dot (MoeGemmTiles.paired) against the two-dot kernel and the
    reference: plain SwiGLU, and gpt-oss's biases and clamped activation; an intermediate size
    that is not a multiple of block_n masks the last column block. 4-bit experts ignore the flag
    (their words are N-contiguous). Bound: fp32, 1e-5 between the kernels (the same products,
    summed per column in one dot or the other), 1e-4 to the reference."""
    from homelab_llm.engine.kernels.fused_moe import fused_moe
    from homelab_llm.engine.kernels.moe_gptoss_ref import gptoss_experts_ref
    from homelab_llm.engine.kernels.tuning import GemmTiles, MoeGemmTiles

    gemm = GemmTiles(32, 32, 32, num_warps=4, num_stages=2)  # fp32 operands fit every GPU
    paired, plain = MoeGemmTiles(gemm, gemm, paired=True), MoeGemmTiles(gemm, gemm)
    gen = torch.Generator().manual_seed(21)
    e, h, i, top_k = 6, 64, 40, 2
    x, w13, w2, b13, b2, weights, ids = _gptoss_inputs(gen, 70, e, h, i, top_k, torch.float32, device)
    cases = (({}, moe_experts_ref(x, w13, w2, weights, ids)),
             (dict(b13=b13, b2=b2, clamp=(1.702, 0.7)),
              gptoss_experts_ref(x, w13, b13, w2, b2, weights, ids, 1.702, 0.7)))
    for kw, want in cases:
        got = fused_moe(x, w13, w2, weights, ids, tiles=paired, **kw)
        two = fused_moe(x, w13, w2, weights, ids, tiles=plain, **kw)
        assert rel_err(got, two) < _fp32_bound(1e-5, device), rel_err(got, two)
        assert rel_err(got, want) < _fp32_bound(1e-4, device), rel_err(got, want)
    w4 = MoeW4(random_moe_w4(gen, e, h, 2 * 64, 32, device), random_moe_w4(gen, e, 64, h, 32, device))
    got = fused_moe(x * 0.05, w4, None, weights, ids, tiles=paired)
    want = moe_experts_ref(x * 0.05, w4, None, weights, ids)
    assert rel_err(got, want) < _fp32_bound(1e-4, device), rel_err(got, want)


def test_combine_matches_reference(device):
    from homelab_llm.engine.kernels.fused_moe import moe_combine

    gen = torch.Generator().manual_seed(7)
    weights, _ = _picks(gen, 5, 8, 3, device)
    y = torch.randn(15, 96, generator=gen).to(device)
    torch.testing.assert_close(moe_combine(y, weights), moe_combine_ref(y, weights),
                               atol=1e-6, rtol=1e-6)


def test_decode_reads_each_active_expert_once(device):
    """At decode sizes every used block is a distinct expert: one weight read per expert."""
    from homelab_llm.engine.kernels.fused_moe import moe_tiles
    from homelab_llm.engine.kernels.moe_align import moe_align

    gen = torch.Generator().manual_seed(3)
    for tokens in (1, 2, 8):
        _, ids = _picks(gen, tokens, 32, 8, device)
        block_m = moe_tiles(tokens * 8, 32, device).up.block_m
        _, block_expert, _ = moe_align(ids, 32, block_m)
        used = block_expert[block_expert >= 0].cpu()
        assert len(used) == len(set(used.tolist())) == len(set(ids.flatten().tolist()))
        # The grid is ~T*K blocks (at most one per slot plus the fill), never one per expert.
        assert block_expert.numel() <= tokens * 8 + -(-tokens * 8 // block_m)


def _gptoss_inputs(gen, tokens, e, h, i, top_k, dtype, device):
    w13, w2 = _experts(gen, e, h, i, dtype, device)
    b13 = (torch.randn(e, 2 * i, generator=gen) * 0.5).to(dtype).to(device)
    b2 = (torch.randn(e, h, generator=gen) * 0.5).to(dtype).to(device)
    x = (torch.randn(tokens, h, generator=gen) * 2).to(dtype).to(device)
    weights, ids = _picks(gen, tokens, e, top_k, device)
    return x, w13, w2, b13, b2, weights, ids


@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_fused_moe_gptoss_matches_reference(tokens, dtype, bound, device, full_shapes):
    """Biased experts and the clamped SwiGLU (limit small enough that the clamps bite), with and
    without the down bias (TP ranks > 0 pass none). Bounds as test_fused_moe_matches_reference."""
    from homelab_llm.engine.kernels.fused_moe import fused_moe
    from homelab_llm.engine.kernels.moe_gptoss_ref import gptoss_experts_ref

    e, h, i, top_k = (32, 2880, 2880, 4) if full_shapes else (8, 64, 48, 2)
    gen = torch.Generator().manual_seed(300 + tokens)
    x, w13, w2, b13, b2, weights, ids = _gptoss_inputs(gen, tokens, e, h, i, top_k, dtype, device)
    for down_bias in (b2, None):
        got = fused_moe(x, w13, w2, weights, ids, b13=b13, b2=down_bias, clamp=(1.702, 0.7))
        want = gptoss_experts_ref(x, w13, b13, w2, down_bias, weights, ids, 1.702, 0.7)
        assert rel_err(got, want) < _fp32_bound(bound, device), rel_err(got, want)


def _random_mx4(gen, e, n, k, device):
    from homelab_llm.engine.kernels.moe_ref import Mx4Weight

    blocks = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(120, 127, (e, n, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    return Mx4Weight(blocks.to(device), scales.to(device))


@pytest.mark.parametrize("tokens", [1, 5, 9])
def test_fused_moe_mxfp4_matches_reference(tokens, device, full_shapes, monkeypatch):
    """MXFP4 experts decoded in the kernels (the decode GEMV up to 8 tokens, the tl.dot path at
    any count, its gated GEMM also at half the tiles' width: ArchTiles.mx4_gated_half_width,
    gfx1100's) == the same experts dequantized by
    moe_gptoss_ref.dequantize_mxfp4_ref (every code and scale exact in fp32, so the bound is the
    fp32 one; bf16 activations at full shapes: 2e-2)."""
    from homelab_llm.engine.kernels import tuning
    from homelab_llm.engine.kernels.fused_moe import fused_moe
    from homelab_llm.engine.kernels.moe_gptoss_ref import gptoss_experts_ref
    from homelab_llm.engine.kernels.moe_ref import MoeMx4

    e, h, i, top_k = (32, 2880, 2880, 4) if full_shapes else (8, 64, 96, 2)
    dtype = torch.bfloat16 if full_shapes else torch.float32
    gen = torch.Generator().manual_seed(400 + tokens)
    mx4 = MoeMx4(_random_mx4(gen, e, 2 * i, h, device), _random_mx4(gen, e, h, i, device))
    b13 = (torch.randn(e, 2 * i, generator=gen) * 0.1).to(dtype).to(device)
    b2 = (torch.randn(e, h, generator=gen) * 0.1).to(dtype).to(device)
    x = torch.randn(tokens, h, generator=gen).to(dtype).to(device)
    weights, ids = _picks(gen, tokens, e, top_k, device)
    got = fused_moe(x, mx4, None, weights, ids, b13=b13, b2=b2, clamp=(1.702, 7.0))
    dot_path = fused_moe(x, mx4, None, weights, ids, b13=b13, b2=b2, clamp=(1.702, 7.0),
                         decode="gemm")
    w13 = torch.stack([mx4.w13.dense(j, dtype) for j in range(e)])
    w2 = torch.stack([mx4.w2.dense(j, dtype) for j in range(e)])
    want = gptoss_experts_ref(x, w13, b13, w2, b2, weights, ids, 1.702, 7.0)
    also = gptoss_experts_ref(x, mx4, b13, None, b2, weights, ids, 1.702, 7.0)
    assert torch.equal(want, also)
    bound = 2e-2 if full_shapes else 1e-4
    assert rel_err(got, want) < bound, ("gemv", rel_err(got, want))
    assert rel_err(dot_path, want) < bound, ("dot", rel_err(dot_path, want))
    table = tuning.tiles_for(device)
    flipped = dataclasses.replace(table, mx4_gated_half_width=not table.mx4_gated_half_width)
    monkeypatch.setitem(tuning.TABLE, table.name, flipped)
    other = fused_moe(x, mx4, None, weights, ids, b13=b13, b2=b2, clamp=(1.702, 7.0), decode="gemm")
    assert rel_err(other, want) < bound, ("dot, other width", rel_err(other, want))
