"""KV store kernel against store_kv_ref: bit-exact for float caches; int8 up to the rounding of
the Hadamard rotation's fp32 sums (the kernel's dot and torch's matmul add in different orders)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import int8_to_fp16
from homelab_llm.engine.kernels.ref import store_kv_ref


def _caches(num_pages: int, page_size: int, heads: int, d: int, dtype: torch.dtype, device: torch.device):
    k = torch.zeros(num_pages, page_size, heads, d, dtype=dtype, device=device)
    v = torch.zeros_like(k)
    if dtype != torch.int8:
        return k, v, None, None
    ks = torch.zeros(num_pages, page_size, heads, dtype=torch.float16, device=device)
    return k, v, ks, torch.zeros_like(ks)


def _assert_same_caches(got, want) -> None:
    """Float caches bit-exact. int8 (k, v, k_scale, v_scale): the rotated rows may differ by an
    fp32 ulp, which moves a code across a rounding boundary (by one) or a scale by an fp16 ulp
    only rarely: at most 1e-4 of codes and 1e-3 of scales differ, and never by more than that."""
    if got[2] is None:
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        return
    for g, w in zip(got[:2], want[:2]):
        diff = (g.int() - w.int()).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) <= 1e-4
    for g, w in zip(got[2:], want[2:]):
        close = (g.float() - w.float()).abs() <= 1e-3 * w.float().abs()
        assert close.all() and float((g != w).float().mean()) <= 1e-3


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
def test_store_matches_reference_exactly(cache_dtype: torch.dtype, device: torch.device, full_shapes: bool) -> None:
    from homelab_llm.engine.kernels.kv_store import store_kv

    gen = torch.Generator().manual_seed(0)
    tokens, heads, d, page_size, pages = (4096, 8, 128, 16, 300) if full_shapes else (37, 3, 32, 4, 12)
    key = (torch.randn(tokens, heads, d, generator=gen) * 3).to(device, torch.bfloat16)
    value = torch.randn(tokens, heads, d, generator=gen).to(device, torch.bfloat16)
    # Exact .5 ties after scaling and an all-zero head, the cases rounding code gets wrong.
    key[0, 0, :4] = torch.tensor([127.0, 0.5, -1.5, 2.5])
    value[1, 0] = 0.0
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens].to(device)
    slots[3] = -1  # padding
    got = _caches(pages, page_size, heads, d, cache_dtype, device)
    want = _caches(pages, page_size, heads, d, cache_dtype, device)
    store_kv(key, value, got[0], got[1], slots, got[2], got[3])
    store_kv_ref(key, value, want[0], want[1], slots, want[2], want[3])
    _assert_same_caches(got, want)


def test_store_to_strided_cache_view(device: torch.device) -> None:
    """Caches are often views into one pool tensor; strides must be honoured."""
    from homelab_llm.engine.kernels.kv_store import store_kv

    gen = torch.Generator().manual_seed(1)
    pool = torch.zeros(2, 6, 4, 2, 32, device=device)  # [k/v, pages, page_size, heads, d]
    key = torch.randn(5, 2, 32, generator=gen).to(device)
    value = torch.randn(5, 2, 32, generator=gen).to(device)
    slots = torch.tensor([0, 5, 9, 23, 11], device=device)
    store_kv(key, value, pool[0], pool[1], slots)
    flat_k = pool[0].reshape(-1, 2, 32)
    torch.testing.assert_close(flat_k[slots], key, atol=0.0, rtol=0.0)
    assert pool[1].reshape(-1, 2, 32)[slots].equal(value)



@triton.jit
def _convert_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, int8_to_fp16(tl.load(x_ptr + offs)))


def test_int8_to_fp16_bit_trick_is_exact(device: torch.device) -> None:
    """The int8 -> fp16 conversion the attention kernels use for int8 KV, over all 256 values."""
    x = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).to(device)
    out = torch.empty(256, dtype=torch.float16, device=device)
    _convert_kernel[(1,)](x, out, N=256)
    assert torch.equal(out, x.to(torch.float16))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("rot_fraction", [1.0, 0.5])
def test_fused_rope_store_matches_unfused(cache_dtype: torch.dtype, rot_fraction: float,
                                          device: torch.device, full_shapes: bool) -> None:
    """rope_store_kv == apply_rope then store_kv: q rotated in place, rotated k (rounded to bf16,
    then quantized for int8) in the cache, the input k left alone. Bit-exact against the unfused
    Triton kernels (int8: up to rotation rounding, see _assert_same_caches), and within bf16
    rounding of the torch reference (int8: one quantization step)."""
    from homelab_llm.engine.kernels import ref
    from homelab_llm.engine.kernels.elementwise import apply_rope
    from homelab_llm.engine.kernels.kv_store import rope_store_kv, store_kv

    gen = torch.Generator().manual_seed(4)
    tokens, hq, hkv, d, page_size, pages = (256, 32, 8, 128, 16, 40) if full_shapes else (9, 4, 2, 32, 4, 5)
    rot = int(d * rot_fraction)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    table = ref.rope_cos_sin_cache(ref.rope_inv_freq(rot, 500000.0, scaling), 4096, device)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(device)
    qkv = (torch.randn(tokens, hq + 2 * hkv, d, generator=gen) * 2).to(device, torch.bfloat16)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]  # views into one fused output
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens].to(device)
    slots[1] = -1  # padding: q still rotated, nothing stored

    got = _caches(pages, page_size, hkv, d, cache_dtype, device)
    q_fused, k_before = q.clone(), k.clone()
    rope_store_kv(q_fused, k, v, positions, table, *got[:2], slots, *got[2:])
    assert torch.equal(k, k_before)

    q_unfused, k_rot = q.clone(), k.clone()
    apply_rope(q_unfused, k_rot, positions, table)
    want = _caches(pages, page_size, hkv, d, cache_dtype, device)
    store_kv(k_rot, v, *want[:2], slots, *want[2:])
    assert torch.equal(q_fused, q_unfused)
    _assert_same_caches(got, want)

    q_ref, k_ref = q.clone(), k.clone()
    ref.apply_rope_ref(q_ref, k_ref, positions, table)
    torch.testing.assert_close(q_fused, q_ref, atol=2e-2, rtol=2e-2)
    flat = [c.reshape(pages * page_size, *c.shape[2:]) if c is not None else None for c in got]
    keep = slots >= 0
    stored_k = flat[0][slots[keep]]
    if cache_dtype == torch.int8:
        step = flat[2][slots[keep]].float()
        stored_k = stored_k.float() * step[..., None]
        # The cache holds the Hadamard-rotated row (ref.quantize_kv): within half a step of it,
        # plus what a bf16 ulp per element (where rotations round apart) adds up to over the row.
        want_k = ref.rotate_kv(k_ref[keep])
        ulps = 1e-2 * k_ref[keep].float().abs().sum(-1, keepdim=True)
        assert ((stored_k - want_k).abs() <= step[..., None] * 0.5 + ulps + 1e-3).all()
        back = ref.dequantize_kv(flat[0][slots[keep]], flat[2][slots[keep]], torch.float32)
        assert ((back - k_ref[keep].float()).abs() <= step.amax(-1, keepdim=True)[..., None] + ulps).all()
    else:
        torch.testing.assert_close(stored_k.float(), k_ref[keep].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype,rot_fraction,gated", [
    (torch.bfloat16, 1.0, False), (torch.int8, 1.0, False),  # Qwen3 / Qwen3-MoE
    (torch.bfloat16, 0.25, True), (torch.int8, 0.25, True),  # the 27B's gated attention
])
def test_rope_store_with_qk_norm_matches_norm_then_store(cache_dtype, rot_fraction, gated,
                                                         device, full_shapes) -> None:
    """rope_store_kv(qk_norm=...) on the projection's q and k (strided views; gated: each q
    head followed by its gate) == elementwise.qk_norm, then rope_store_kv: q (a new tensor)
    equal up to the norms' fp32 sum order (an ulp of bf16 at most, on few elements), the caches
    as _assert_same_caches holds them, the projection untouched."""
    from homelab_llm.engine.kernels import ref
    from homelab_llm.engine.kernels.elementwise import qk_norm
    from homelab_llm.engine.kernels.kv_store import rope_store_kv

    gen = torch.Generator().manual_seed(6)
    tokens, hq, hkv, d, page_size, pages = (64, 24, 4, 256, 16, 8) if full_shapes else (5, 4, 2, 32, 4, 3)
    rot = int(d * rot_fraction)
    table = ref.rope_cos_sin_cache(ref.rope_inv_freq(rot, 10000.0, None), 512, device)
    positions = torch.randint(0, 512, (tokens,), generator=gen).to(device)
    q_step = 2 * d if gated else d
    qkv = (torch.randn(tokens, hq * q_step + 2 * hkv * d, generator=gen) * 3).to(device, torch.bfloat16)
    qw = (torch.rand(d, generator=gen) + 0.5).to(device, torch.bfloat16)
    kw = (torch.rand(d, generator=gen) + 0.5).to(device, torch.bfloat16)
    q = qkv[:, :hq * q_step].view(tokens, hq, q_step)[..., :d]
    k = qkv[:, hq * q_step:hq * q_step + hkv * d].view(tokens, hkv, d)
    v = qkv[:, hq * q_step + hkv * d:].view(tokens, hkv, d)
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens].to(device)
    slots[0] = -1
    before = qkv.clone()

    got = _caches(pages, page_size, hkv, d, cache_dtype, device)
    q_got = rope_store_kv(q, k, v, positions, table, *got[:2], slots, *got[2:],
                          qk_norm=(qw, kw, 1e-6))
    assert torch.equal(qkv, before) and q_got.shape == (tokens, hq, d)

    qk = qk_norm(qkv, hq, hkv, d, qw, kw, 1e-6, q_step=q_step)
    want = _caches(pages, page_size, hkv, d, cache_dtype, device)
    q_want = rope_store_kv(qk[:, :hq], qk[:, hq:], v, positions, table, *want[:2], slots, *want[2:])
    diff = (q_got.float() - q_want.float()).abs()
    assert float(diff.max()) <= 2 ** -7 * float(q_want.float().abs().max())
    assert float((diff > 0).float().mean()) <= 0.02
    if cache_dtype == torch.int8:
        _assert_same_caches(got, want)
    else:  # the same ulp-rare differences as q
        for g, w in zip(got[:2], want[:2]):
            assert float(((g.float() - w.float()).abs() > 0).float().mean()) <= 0.02
            torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2 ** -7)


def test_partial_rotary_int8_store_is_one_launch(device, full_shapes) -> None:
    """Rotated int8 rows with partial rotary (the 27B's attention: a quarter of head_dim 256
    rotated): rope_store_kv writes them in its one launch (the rotated row through scratch, then
    butterflies), matching apply_rope then store_kv (q bit-exact; caches: _assert_same_caches)."""
    from homelab_llm.engine.kernels import ref
    from homelab_llm.engine.kernels.elementwise import apply_rope
    from homelab_llm.engine.kernels.kv_store import rope_store_kv, store_kv

    gen = torch.Generator().manual_seed(12)
    tokens, hq, hkv, d, page_size, pages = (64, 24, 4, 256, 16, 8) if full_shapes else (5, 4, 2, 64, 4, 3)
    rot = d // 4
    table = ref.rope_cos_sin_cache(ref.rope_inv_freq(rot, 10000.0, None), 512, device)
    positions = torch.randint(0, 512, (tokens,), generator=gen).to(device)
    qkv = (torch.randn(tokens, hq + 2 * hkv, d, generator=gen) * 2).to(device, torch.bfloat16)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens].to(device)
    slots[2] = -1
    got = _caches(pages, page_size, hkv, d, torch.int8, device)
    q_fused = q.clone()
    rope_store_kv(q_fused, k, v, positions, table, *got[:2], slots, *got[2:])
    q_unfused, k_rot = q.clone(), k.clone()
    apply_rope(q_unfused, k_rot, positions, table)
    want = _caches(pages, page_size, hkv, d, torch.int8, device)
    store_kv(k_rot, v, *want[:2], slots, *want[2:])
    assert torch.equal(q_fused, q_unfused)
    for g, w in zip(got, want):  # the same butterflies on the same rounded rows: the same bits
        assert torch.equal(g, w)
