"""CPU decode attention and KV store for the common case, in the fewest torch ops.

A CPU decode step of a small model spends about as much time dispatching small ops as in its
matmuls, so the per-layer attention of batch-1 decode (one sequence, one new token) skips the
reference's general machinery (per-sequence loop, masks, output scatter) and runs as: gather the
sequence's pages, one fused SDPA call with the query heads grouped under their KV head (no K/V
expansion), on one thread (kernels/cpu_threads.py), views. The store writes K/V rows with
index_copy_.

Covered: fp32/bf16/fp16 caches (not int8), no sliding window, no attention sinks, every slot
valid. Anything else returns None / False and the caller runs the reference (kernels/ref.py);
the results are the reference's (tests/engine/kernels/test_attention_cpu.py compares them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from homelab_llm.engine.kernels.cpu_threads import single_thread


def decode_one_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        page_table: torch.Tensor, seq_len: int,
                        softmax_scale: float) -> torch.Tensor | None:
    """q [1, Hq, D] of one sequence at position seq_len - 1, over its first seq_len cached keys
    -> [1, Hq, D]; None when the cache is int8 (the reference dequantizes)."""
    if k_cache.dtype == torch.int8:
        return None
    page_size, hkv, d = k_cache.shape[1:]
    hq = q.shape[1]
    # One thread (kernels/cpu_threads.py): the gather and the fused kernel's few KV-head work
    # items cost less than the pool's fork/join, 30 times per token.
    with single_thread():
        pages = page_table[0, : (seq_len + page_size - 1) // page_size]
        k = k_cache.index_select(0, pages).view(-1, hkv, d)[:seq_len].transpose(0, 1)
        v = v_cache.index_select(0, pages).view(-1, hkv, d)[:seq_len].transpose(0, 1)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        # Query head h reads KV head h // (hq // hkv): the group's queries are its "query rows".
        grouped = q.reshape(1, hkv, hq // hkv, d)
        out = F.scaled_dot_product_attention(grouped, k.unsqueeze(0), v.unsqueeze(0),
                                             scale=softmax_scale)
    return out.view(1, hq, d)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Write key/value [T, Hkv, D] at slot_mapping [T] of a float cache; False (nothing written)
    for an int8 cache or when a slot is negative (padding): the reference handles those."""
    if k_cache.dtype == torch.int8 or slot_mapping.dtype != torch.int64 \
            or slot_mapping.numel() == 0 or int(slot_mapping.min()) < 0:
        return False
    if key.dtype != k_cache.dtype:
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    rows = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(rows, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(rows, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)
    return True
