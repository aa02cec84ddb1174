"""V caches stored dim-major within each page (cache/page_pool.KVLayout.v_dim_major: memory
[pages, heads, head_dim, page_size] seen as [pages, page_size, heads, head_dim]): every kernel
that writes or reads V gives what it gives on the token-major layout.

Each case runs twice on the same values, once per layout: the stores (store_kv, rope_store_kv;
the decode kernel's own new K/V in test_decode_new_kv.py) must leave the same cache contents,
the readers (decode with splits, windows, sinks, verify groups, the prefetching tiles; prefill)
the same output. Through
the interpreter the two runs do the same arithmetic, so the bound is exact equality; on a GPU
the NVIDIA build converts dim-major int8 V in PTX (common.int8_to_fp16_ptx, the same values), and
the bound is one bf16 rounding of the output (2^-8 relative). Each output is also checked against
paged_attention_ref (2e-2 on unit-variance bf16 values, test_decode_attention's bound), and the
page pool's layout and slot copies, and when the runner asks for it, are checked here too.
"""

from __future__ import annotations

import inspect
import os
import re
import struct

import pytest
import torch

from homelab_llm.engine.kernels import ref
from homelab_llm.engine.kernels.common import kv_cache_args
from homelab_llm.engine.kernels.tuning import AttentionTiles

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
PREFETCHING = AttentionTiles(32, 1, 1, int8_dot=True, prefetch_scales=True, prefetch_kv=True,
                             fused_merge=True, late_q=True)


def dim_major(v: torch.Tensor) -> torch.Tensor:
    """The same values as v [pages, page_size, heads, head_dim], stored dim-major per page."""
    raw = torch.empty((v.shape[0], v.shape[2], v.shape[3], v.shape[1]), dtype=v.dtype, device=v.device)
    raw.copy_(v.permute(0, 2, 3, 1))
    return raw.permute(0, 3, 1, 2)


def assert_same_output(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if INTERPRETED:
        assert torch.equal(got, want), what
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=2 ** -8, msg=lambda m: f"{what}: {m}")


def test_the_layout_is_seen_through_its_strides(device) -> None:
    v = dim_major(torch.zeros(3, 4, 2, 8, dtype=torch.int8, device=device))
    k = torch.zeros(3, 4, 2, 8, dtype=torch.int8, device=device)
    s = torch.ones(3, 4, 2, dtype=torch.float16, device=device)
    args = kv_cache_args(k, v, s, s, 8)
    assert args.v_dim_major and args.strides[3:7] == (64, 1, 32, 4)
    assert not kv_cache_args(k, k, s, s, 8).v_dim_major
    with pytest.raises(ValueError, match="head_dim or its slot axis"):
        kv_cache_args(k, torch.zeros(3, 4, 2, 16, dtype=torch.int8, device=device)[..., ::2], s, s, 8)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.bfloat16], ids=["int8", "bf16"])
def test_stores_leave_the_same_values(kv_dtype, device) -> None:
    from homelab_llm.engine.kernels.kv_store import rope_store_kv, store_kv

    gen = torch.Generator().manual_seed(11)
    tokens, heads, d, page_size, pages = 21, 2, 32, 4, 9
    key = torch.randn(tokens, heads, d, generator=gen).to(device, torch.bfloat16)
    value = torch.randn(tokens, heads, d, generator=gen).to(device, torch.bfloat16)
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens].to(device)
    slots[2] = -1
    shape = (pages, page_size, heads, d)
    for store in ("store_kv", "rope_store_kv"):
        runs = []
        for dm in (False, True):
            k = torch.zeros(shape, dtype=kv_dtype, device=device)
            v = dim_major(torch.zeros_like(k)) if dm else torch.zeros_like(k)
            scales = [torch.zeros(shape[:3], dtype=torch.float16, device=device) for _ in range(2)] \
                if kv_dtype == torch.int8 else [None, None]
            if store == "store_kv":
                store_kv(key, value, k, v, slots, *scales)
            else:
                cos_sin = ref.rope_cos_sin_cache(ref.rope_inv_freq(d, 10000.0, None), 64, device)
                q = torch.randn(tokens, 4, d, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
                rope_store_kv(q, key.clone(), value, torch.arange(tokens, device=device), cos_sin, k, v, slots,
                              *scales)
            runs.append([k, v.contiguous()] + scales)
        for a, b in zip(*runs):
            assert a is None or torch.equal(a, b), store
    # and the reference store writes the dim-major layout the same way
    k = torch.zeros(shape, dtype=torch.int8, device=device)
    v_tok, v_dim = torch.zeros_like(k), dim_major(torch.zeros_like(k))
    s = [torch.zeros(shape[:3], dtype=torch.float16, device=device) for _ in range(2)]
    ref.store_kv_ref(key, value, k, v_tok, slots, *s)
    ref.store_kv_ref(key, value, k, v_dim, slots, *s)
    assert torch.equal(v_tok, v_dim.contiguous())


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.bfloat16], ids=["int8", "bf16"])
def test_decode_reads_the_same(kv_dtype, device, full_shapes, paged_kv) -> None:
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(5)
    if full_shapes:
        seq_lens, hq, hkv, d, page_size = [16384, 3000, 17], 32, 8, 128, 16
    else:
        seq_lens, hq, hkv, d, page_size = [1, 23, 70], 8, 2, 32, 4
    k_cache, v_cache, ks, vs, table = paged_kv(seq_lens, hkv, d, page_size, kv_dtype, device, gen)
    v_dim = dim_major(v_cache)
    batch = len(seq_lens)
    q = torch.randn(batch, hq, d, generator=gen).to(device, torch.bfloat16)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    sinks = torch.randn(hq, generator=gen).to(device)
    kf = k_cache if kv_dtype == torch.int8 else k_cache.float()
    vf = v_cache if kv_dtype == torch.int8 else v_cache.float()
    cases = [dict(num_splits=None), dict(num_splits=1), dict(num_splits=4), dict(num_splits=4, tiles=PREFETCHING),
             dict(num_splits=2, window=9, sinks=sinks), dict(num_splits=None, window=13)]
    for case in cases:
        want = ref.paged_attention_ref(q.float(), kf, vf, table, qsl, sl, d ** -0.5, ks, vs,
                                       window=case.get("window", 0), sinks=case.get("sinks"))
        tok = paged_decode_attention(q, k_cache, v_cache, table, qsl, sl, d ** -0.5, ks, vs, **case)
        dim = paged_decode_attention(q, k_cache, v_dim, table, qsl, sl, d ** -0.5, ks, vs, **case)
        assert_same_output(dim, tok, str(case))
        torch.testing.assert_close(dim.float(), want, atol=2e-2, rtol=2e-2, msg=lambda m: f"{case}: {m}")


def test_verify_groups_read_the_same(device, paged_kv) -> None:
    """Groups of 3 rows (a sequence's token and 2 drafts), each row seeing one more key."""
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(6)
    width, hq, hkv, d, page_size = 3, 4, 2, 32, 4
    ctx = [9, 30]
    k_cache, v_cache, ks, vs, tables = paged_kv([n + width for n in ctx], hkv, d, page_size, torch.int8, device, gen)
    lens = [n + 1 + j for n in ctx for j in range(width)]
    table = tables.repeat_interleave(width, dim=0)
    q = torch.randn(len(lens), hq, d, generator=gen).to(device, torch.bfloat16)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    for splits in (None, 1):
        args = (table, qsl, sl, d ** -0.5, ks, vs)
        tok = paged_decode_attention(q, k_cache, v_cache, *args, num_splits=splits, rows_per_seq=width)
        dim = paged_decode_attention(q, k_cache, dim_major(v_cache), *args, num_splits=splits, rows_per_seq=width)
        assert_same_output(dim, tok, f"{splits=}")


@pytest.mark.parametrize("window", [0, 6])
def test_prefill_reads_the_same(window, device, paged_kv) -> None:
    from homelab_llm.engine.kernels.prefill_attention import paged_prefill_attention

    gen = torch.Generator().manual_seed(9)
    seq_lens, q_lens, hq, hkv, d, page_size = [19, 40], [7, 12], 4, 2, 32, 4
    k_cache, v_cache, ks, vs, table = paged_kv(seq_lens, hkv, d, page_size, torch.int8, device, gen)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(device, torch.bfloat16)
    qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (table, qsl, sl, d ** -0.5, ks, vs)
    want = ref.paged_attention_ref(q.float(), k_cache, v_cache, *args, window=window)
    tok = paged_prefill_attention(q, k_cache, v_cache, *args, window=window)
    dim = paged_prefill_attention(q, k_cache, dim_major(v_cache), *args, window=window)
    assert_same_output(dim, tok, f"{window=}")
    torch.testing.assert_close(dim.float(), want, atol=2e-2, rtol=2e-2)


def test_the_page_pool_stores_v_dim_major_when_asked(device) -> None:
    from homelab_llm.engine.cache.page_pool import KVLayout, PagePool

    pools = [PagePool(KVLayout(2, 2, 8, 4, torch.int8, v_dim_major=dm), 5, device) for dm in (False, True)]
    assert pools[0].v_caches[0].stride(3) == 1
    assert pools[1].v_caches[0].stride(1) == 1 and pools[1].v_caches[0].shape == (5, 4, 2, 8)
    assert pools[1].k_caches[0].stride(3) == 1  # K stays token-major
    gen = torch.Generator().manual_seed(2)
    values = torch.randint(-127, 128, (5, 4, 2, 8), generator=gen, dtype=torch.int8).to(device)
    for pool in pools:
        for v in pool.v_caches:
            v.copy_(values)
        pool.copy_slots([1, 2, 13], [17, 6, 0])
    assert torch.equal(pools[0].v_caches[1], pools[1].v_caches[1].contiguous())
    assert torch.equal(pools[1].v_caches[0][4, 1], values[0, 1]) and torch.equal(pools[1].v_caches[0][0, 0],
                                                                                  values[3, 1])


def test_the_runner_asks_for_it_on_nvidia_and_when_told(monkeypatch) -> None:
    from homelab_llm.engine.kernels import dispatch

    cuda = torch.device("cuda")  # also ROCm's device type
    monkeypatch.delenv("HOMELAB_LLM_KV_V_LAYOUT", raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert dispatch.int8_v_dim_major(cuda, torch.int8)  # on by default on NVIDIA (timed there)
    monkeypatch.setenv("HOMELAB_LLM_KV_V_LAYOUT", "token")
    assert not dispatch.int8_v_dim_major(cuda, torch.int8)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.delenv("HOMELAB_LLM_KV_V_LAYOUT")
    assert not dispatch.int8_v_dim_major(cuda, torch.int8)  # off by default on ROCm (untimed)
    monkeypatch.setenv("HOMELAB_LLM_KV_V_LAYOUT", "dim")
    assert dispatch.int8_v_dim_major(cuda, torch.int8)
    assert not dispatch.int8_v_dim_major(torch.device("cpu"), torch.int8)
    assert not dispatch.int8_v_dim_major(cuda, torch.bfloat16)
    monkeypatch.setenv("HOMELAB_LLM_KERNELS", "ref")
    assert not dispatch.int8_v_dim_major(cuda, torch.int8)


def test_the_ptx_conversion_gives_every_int8_value() -> None:
    """common.int8_to_fp16_ptx's PTX, run by the PTX ISA's rules (xor; prmt.b32 d, a, b, c picks
    d's byte i from the 8 bytes of {b, a} by c's nibble i), over every value in every lane of a
    word: the four fp16 results, elements 0-1 in the first register and 2-3 in the second (low
    half first: Triton's packing of four values), minus 1152, are the four int8 values. A GPU
    test checks the same through the compiled kernels (test_decode_reads_the_same)."""
    from homelab_llm.engine.kernels import common

    module = inspect.getsource(common)
    src = module[module.index("def int8_to_fp16_ptx"):module.index("def load_paged_kv")]
    xor = int(re.search(r"xor\.b32 t, \$2, (0x[0-9a-f]+);", src).group(1), 16)
    prmts = [(int(b, 16), int(c, 16))
             for b, c in re.findall(r"prmt\.b32 \$[01], t, (0x[0-9a-f]+), (0x[0-9a-f]+);", src)]
    assert len(prmts) == 2 and "- 1152.0" in src

    def prmt(a: int, b: int, c: int) -> int:
        pool = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
        return sum(pool[(c >> 4 * i) & 7] << 8 * i for i in range(4))

    def halves(r: int) -> list[float]:
        return [struct.unpack("<e", struct.pack("<H", (r >> s) & 0xFFFF))[0] for s in (0, 16)]

    for lane in range(4):
        for value in range(-128, 128):
            values = [(value + 37 * j) % 256 - 128 if j != lane else value for j in range(4)]
            word = sum((v & 0xFF) << 8 * j for j, v in enumerate(values))
            t = word ^ xor
            got = halves(prmt(t, *prmts[0])) + halves(prmt(t, *prmts[1]))
            assert [g - 1152.0 for g in got] == values, (lane, value)
