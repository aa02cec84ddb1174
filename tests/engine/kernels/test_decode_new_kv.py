"""The decode attention that rotates and stores the step's new K/V itself
(paged_decode_attention(new_kv=...)) against rope_store_kv then paged_decode_attention, on copies
of the same paged caches: bf16 and int8 caches (Hadamard-rotated at head_dim 32/64, plain at 48),
partial rotary, GQA groups of 1-8, one split and splits past the short sequences' ends, the
arch table's tiles and the prefetching / fused-merge variant, a window with sinks, a padding row
(slot -1: nothing stored), and q, k, v as strided views of one projection.

Bounds: the cache rows and scales bit-equal (the same store code, kv_store.store_rotated_kv);
without q/k norms the output bit-equal too (q's rotation is the same arithmetic per value). With
them q's per-head sum of squares runs in another order, which can move a bf16 rounding of q by
an ulp: the output within 2e-2 (bf16 values of unit scale), a missing or misapplied norm or
rotation is of order 1.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from homelab_llm.engine.kernels import ref
from homelab_llm.engine.kernels.decode_attention import paged_decode_attention
from homelab_llm.engine.kernels.kv_store import NewKV, rope_store_kv
from homelab_llm.engine.kernels.tuning import AttentionTiles

# (seq_lens, q_heads, kv_heads, head_dim, page_size, rotary_dim)
SHAPES = [([1, 7, 40, 101], 8, 2, 32, 4, 32), ([70, 5], 8, 1, 64, 8, 32), ([9, 3], 2, 1, 48, 4, 48)]
PREFETCHING = AttentionTiles(32, 1, 1, int8_dot=True, prefetch_scales=True, prefetch_kv=True,
                             fused_merge=True, late_q=True)


def _case(paged_kv, device, kv_dtype, shape, seed, qk_norm):
    seq_lens, hq, hkv, d, page, rot = shape
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, ks, vs, table = paged_kv(seq_lens, hkv, d, page, kv_dtype, device, gen)
    batch = len(seq_lens)
    proj = torch.randn(batch, (hq + 2 * hkv) * d, generator=gen).to(device, torch.bfloat16)
    q = proj[:, :hq * d].view(batch, hq, d)
    k = proj[:, hq * d:(hq + hkv) * d].view(batch, hkv, d)
    v = proj[:, (hq + hkv) * d:].view(batch, hkv, d)
    last = torch.tensor(seq_lens, device=device) - 1
    slots = (table[torch.arange(batch, device=device), last // page].long() * page + last % page)
    slots[-1] = -1  # a padding row: its K/V is not stored, its q still attends
    positions = last + 3
    cos_sin = ref.rope_cos_sin_cache(ref.rope_inv_freq(rot, 10000.0, None), 256, device)
    norms = None
    if qk_norm:
        norms = ((1 + 0.3 * torch.randn(d, generator=gen)).to(device, torch.bfloat16),
                 (1 + 0.3 * torch.randn(d, generator=gen)).to(device, torch.bfloat16), 1e-6)
    caches = [k_cache, v_cache, ks, vs]
    return caches, table, proj, q, k, v, positions, cos_sin, slots.to(torch.int64), norms


def _copy(caches):
    return [c.clone() if c is not None else None for c in caches]


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
@pytest.mark.parametrize("tiles", [None, PREFETCHING], ids=["table", "prefetching"])
def test_new_kv_in_the_attention_matches_store_then_attend(qk_norm, kv_dtype, tiles, device,
                                                           paged_kv) -> None:
    for i, shape in enumerate(SHAPES):
        for splits in (1, 8):
            seq_lens, hq, hkv, d = shape[:4]
            caches, table, proj, q, k, v, pos, cos_sin, slots, norms = _case(
                paged_kv, device, kv_dtype, shape, 10 * i + splits, qk_norm)
            qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device)
            sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
            want_c = _copy(caches)
            q_rot = rope_store_kv(q.clone() if norms is None else q, k, v, pos, cos_sin, want_c[0],
                                  want_c[1], slots, want_c[2], want_c[3], qk_norm=norms)
            want = paged_decode_attention(q_rot, want_c[0], want_c[1], table, qsl, sl, d ** -0.5,
                                          want_c[2], want_c[3], num_splits=splits, tiles=tiles)
            got_c = _copy(caches)
            before = proj.clone()
            got = paged_decode_attention(q, got_c[0], got_c[1], table, qsl, sl, d ** -0.5, got_c[2],
                                         got_c[3], num_splits=splits, tiles=tiles,
                                         new_kv=NewKV(k, v, pos, cos_sin, slots, norms))
            what = f"{shape=} {splits=}"
            assert torch.equal(proj, before), f"{what}: the projection was written"
            for g, w in zip(got_c, want_c):
                if w is not None:
                    assert torch.equal(g, w), f"{what}: caches differ"
            if norms is None:
                assert torch.equal(got, want), \
                    f"{what}: output off by {float((got.float() - want.float()).abs().max()):.2e}"
            else:
                torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2,
                                           msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.bfloat16], ids=["int8", "bf16"])
def test_new_kv_into_a_dim_major_v_cache(kv_dtype, device, paged_kv) -> None:
    """V stored dim-major within each page (cache/page_pool.KVLayout.v_dim_major): the program
    owning the step's token stores its K/V rows there itself and attends over them; the caches
    bit-equal to the token-major run's, the output too through the interpreter (one bf16
    rounding on a GPU, where an int8 V tile converts in PTX)."""
    shape = SHAPES[0]
    seq_lens, hq, hkv, d = shape[:4]
    caches, table, _, q, k, v, pos, cos_sin, slots, _ = _case(paged_kv, device, kv_dtype, shape, 8, False)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    runs = []
    for dim_major in (False, True):
        c = _copy(caches)
        if dim_major:  # the same values, stored [pages, heads, head_dim, page]
            c[1] = c[1].permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        out = paged_decode_attention(q, c[0], c[1], table, qsl, sl, d ** -0.5, c[2], c[3], num_splits=2,
                                     new_kv=NewKV(k, v, pos, cos_sin, slots))
        runs.append((out, [x.contiguous() if x is not None else None for x in c]))
    for a, b in zip(runs[0][1], runs[1][1]):
        assert a is None or torch.equal(a, b)
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert torch.equal(runs[1][0], runs[0][0])
    else:
        torch.testing.assert_close(runs[1][0].float(), runs[0][0].float(), atol=1e-3, rtol=2 ** -8)


def test_new_kv_with_a_window_and_sinks(device, paged_kv) -> None:
    """A sliding window and gpt-oss sinks: the last split program still stores the new row."""
    shape = ([40, 23], 4, 2, 32, 4, 32)
    seq_lens, hq, hkv, d = shape[:4]
    caches, table, _, q, k, v, pos, cos_sin, slots, _ = _case(paged_kv, device, torch.bfloat16, shape,
                                                              7, False)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(1)).to(device)
    kw = dict(num_splits=4, window=16, sinks=sinks)
    want_c, got_c = _copy(caches), _copy(caches)
    q_rot = rope_store_kv(q.clone(), k, v, pos, cos_sin, want_c[0], want_c[1], slots)
    want = paged_decode_attention(q_rot, want_c[0], want_c[1], table, qsl, sl, d ** -0.5, **kw)
    got = paged_decode_attention(q, got_c[0], got_c[1], table, qsl, sl, d ** -0.5,
                                 new_kv=NewKV(k, v, pos, cos_sin, slots), **kw)
    assert torch.equal(got_c[0], want_c[0]) and torch.equal(got_c[1], want_c[1])
    assert torch.equal(got, want)


def test_new_kv_refuses_verify_rows_and_bad_shapes(device, paged_kv) -> None:
    shape = ([9, 3], 2, 1, 48, 4, 48)
    caches, table, _, q, k, v, pos, cos_sin, slots, _ = _case(paged_kv, device, torch.bfloat16, shape,
                                                              3, False)
    qsl = torch.arange(3, dtype=torch.int32, device=device)
    sl = torch.tensor([9, 3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="one-token rows"):
        paged_decode_attention(q, caches[0], caches[1], table, qsl, sl, 0.1, rows_per_seq=2,
                               new_kv=NewKV(k, v, pos, cos_sin, slots))
    with pytest.raises(ValueError, match="new K/V rows must be"):
        paged_decode_attention(q, caches[0], caches[1], table, qsl, sl, 0.1,
                               new_kv=NewKV(k[:, :, :32], v, pos, cos_sin, slots))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="counts launches through the Triton interpreter (CPU only)")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_a_decode_step_stores_its_kv_in_the_attention_where_the_tiles_say(cache_dtype, qk_norm,
                                                                          monkeypatch) -> None:
    """Through LlamaAttention.attend on a bound cache: with the decode tiles' new_kv the step
    launches no rope_store_kv and one kernel fewer, writes the same cache and returns the same
    output (qk_norm: within 1e-2, the sum-of-squares order); without it, rope_store_kv as before."""
    from homelab_llm.engine.context import forward_context
    from homelab_llm.engine.kernels import dispatch, tuning
    from homelab_llm.engine.layers.rotary import RotaryEmbedding
    from homelab_llm.engine.model.config import ModelConfig
    from homelab_llm.engine.model.llama import LlamaAttention
    from tests.engine.kernels.launch_count import bind_cache, count_calls, decode_context, random_weights

    heads, kv_heads, d = 4, 2, 32
    config = ModelConfig(architecture="qwen3" if qk_norm else "llama", vocab_size=8, hidden_size=64,
                         intermediate_size=32, num_hidden_layers=1, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=d, qk_norm=qk_norm, name="tiny")
    qkv = (torch.randn(1, (heads + 2 * kv_heads) * d, generator=torch.Generator().manual_seed(9))
           * 2).to(torch.bfloat16)
    rotary = RotaryEmbedding(d, 64, 1000000.0, None)
    runs = []
    for fused in (False, True):
        torch.manual_seed(3)
        attn = random_weights(LlamaAttention(config), 0.2).to(torch.bfloat16)
        bind_cache(attn.attn, cache_dtype, page_size=4)
        monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
        arch = tuning.TABLE["interpret"]
        monkeypatch.setitem(tuning.TABLE, "interpret", dataclasses.replace(
            arch, decode=dataclasses.replace(arch.decode, new_kv=fused),
            decode_int8=None if arch.decode_int8 is None else dataclasses.replace(arch.decode_int8, new_kv=fused)))
        ctx = decode_context()
        with forward_context(ctx):
            rope = rotary.lookup(ctx.positions, torch.bfloat16)
            # first-use buffers outside the count; the store is idempotent. Each call its own
            # projection: rope_store_kv rotates q in place
            attn.attend(qkv.clone(), rope)
            step_qkv = qkv.clone()
            counts, out = count_calls(monkeypatch, lambda: attn.attend(step_qkv, rope))
        monkeypatch.undo()
        runs.append((counts, out, attn.attn))
    (want_counts, want, want_attn), (got_counts, got, got_attn) = runs
    assert want_counts["triton._rope_store_kv_kernel"] == 1
    assert "triton._rope_store_kv_kernel" not in got_counts
    assert sum(got_counts.values()) == sum(want_counts.values()) - 1
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        g, w = getattr(got_attn, name), getattr(want_attn, name)
        assert (g is None) == (w is None) and (g is None or torch.equal(g, w)), name
    if qk_norm:
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    else:
        assert torch.equal(got, want)
