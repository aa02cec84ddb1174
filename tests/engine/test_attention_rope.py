"""Attention with the rope tables passed in (q/k unrotated, rotated inside, fused with the KV store
on a GPU) gives what rotating first and attending gives, for bf16 and int8 caches, prefill then
decode, on whichever device the machine has."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.context import ForwardContext, forward_context
from homelab_llm.engine.layers.attention import Attention
from homelab_llm.engine.layers.rotary import RopeTables, RotaryEmbedding, rotate_qk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HQ, HKV, D, PAGE = 4, 2, 32, 4


def _layer(cache_dtype: torch.dtype) -> Attention:
    attn = Attention(HQ, HKV, D, D ** -0.5)
    shape = (8, PAGE, HKV, D)
    attn.k_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
    attn.v_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
    if cache_dtype == torch.int8:
        attn.k_scale = torch.zeros(shape[:3], dtype=torch.float16, device=DEVICE)
        attn.v_scale = torch.zeros(shape[:3], dtype=torch.float16, device=DEVICE)
    return attn


def _context(positions: list[int], q_lens: list[int], seq_lens: list[int]) -> ForwardContext:
    # Sequence b owns pages 4b..4b+3; its token at position p sits in slot 16b + p.
    owners = [b for b, n in enumerate(q_lens) for _ in range(n)]
    slots = [16 * b + p for b, p in zip(owners, positions)]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return ForwardContext(
        positions=torch.tensor(positions, device=DEVICE),
        slot_mapping=torch.tensor(slots, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        page_table=torch.tensor([[4 * b + i for i in range(4)] for b in range(len(q_lens))],
                                dtype=torch.int32, device=DEVICE),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), page_size=PAGE,
        decode_only=all(n == 1 for n in q_lens), query_lens_host=q_lens, seq_lens_host=seq_lens)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("kernel_tables", [False, True])
def test_rope_inside_attention_matches_rotate_first(cache_dtype: torch.dtype, kernel_tables: bool) -> None:
    torch.manual_seed(0)
    rotary = RotaryEmbedding(D, 64, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 16}).to(DEVICE)
    fused, unfused = _layer(cache_dtype), _layer(cache_dtype)
    steps = [([0, 1, 2, 3, 4, 0, 1, 2], [5, 3], [5, 3]), ([5, 3], [1, 1], [6, 4])]  # prefill, decode
    for positions, q_lens, seq_lens in steps:
        ctx = _context(positions, q_lens, seq_lens)
        tables = rotary.lookup(ctx.positions, torch.bfloat16)
        if kernel_tables:  # the GPU's table form; on the CPU it runs the reference rotation
            tables = RopeTables(ctx.positions, rotary.cos_sin, None, None)
        qkv = torch.randn(len(positions), HQ + 2 * HKV, D, device=DEVICE).to(torch.bfloat16)
        with forward_context(ctx):
            qk = rotate_qk(qkv[:, :HQ + HKV].clone(), HQ, tables)
            want = unfused(qk[:, :HQ], qk[:, HQ:], qkv[:, HQ + HKV:])
            q, k, v = qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
            got = fused(q, k, v, tables)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
            a, b = getattr(fused, name), getattr(unfused, name)
            if a is not None:
                torch.testing.assert_close(a.float(), b.float(), atol=1.0 if a.dtype == torch.int8 else 2e-2,
                                           rtol=0 if a.dtype == torch.int8 else 2e-2)
