"""The W4A16 decode GEMV for experts (fused_moe_gemv.py) vs the torch references, on fresh random
inputs: the whole decode path through fused_moe (T <= 8) and the kernel alone with forced K splits
(the ticket reduction and its in-kernel SiLU-and-mul).

Error bound: 1e-4 relative Frobenius error on fp32 activations in the interpreter (the same
dequantized weights on both sides; observed ~1e-7, a wrong expert/slot/column is O(1)); 2e-2 at
full shapes on a GPU (bf16 activations and outputs, rounded at different points).
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels.moe_ref import MoeW4, moe_align_ref, moe_experts_ref, route_topk_ref
from homelab_llm.engine.kernels.ref import w4a16_matmul_ref
from tests.engine.kernels.moe_inputs import random_moe_w4, rel_err


def _setup(gen, tokens, full_shapes, device):
    e, h, i, top_k, g = (128, 2048, 768, 8, 128) if full_shapes else (8, 64, 96, 4, 32)
    w4 = MoeW4(random_moe_w4(gen, e, h, 2 * i, g, device), random_moe_w4(gen, e, i, h, g, device))
    dtype = torch.bfloat16 if full_shapes else torch.float32
    x = (torch.randn(tokens, h, generator=gen) * 0.1).to(dtype).to(device)
    logits = torch.randn(tokens, e, generator=gen).to(device)
    weights, ids = route_topk_ref(logits, top_k, renormalize=True)
    return w4, x, weights, ids, (2e-2 if full_shapes else 1e-4)


@pytest.mark.parametrize("tokens,decode", [(1, "gemv"), (3, "gemv"), (8, "gemv"), (3, "gemm")])
def test_decode_path_matches_reference(tokens, decode, device, full_shapes):
    """The older GEMV path at T <= 8, and the tl.dot path before it, still right."""
    from homelab_llm.engine.kernels.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(500 + tokens)
    w4, x, weights, ids, bound = _setup(gen, tokens, full_shapes, device)
    got = fused_moe(x, w4, None, weights, ids, decode=decode)
    want = moe_experts_ref(x, w4, None, weights, ids)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel_err(got, want) < bound


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("split,block_m", [(1, 2), (2, 2), (3, 1)])
def test_gemv_splits_match_reference(gated, split, block_m, device, full_shapes):
    """Each slot's row through its expert's projection, K split across programs."""
    from homelab_llm.engine.kernels.fused_moe_gemv import moe_w4_gemv

    tokens = 1 if block_m == 1 else 5
    gen = torch.Generator().manual_seed(split * 10 + block_m + gated)
    w4, x, _, ids, bound = _setup(gen, tokens, full_shapes, device)
    top_k, num_experts = ids.shape[1], w4.w13.qweight.shape[0]
    num_slots = ids.numel()
    sorted_slots, block_expert, _ = moe_align_ref(ids, num_experts, block_m)
    weight = w4.w13 if gated else w4.w2
    n = weight.qweight.shape[2] // 2 if gated else weight.qweight.shape[2]
    # gated: rows by token (x); down: rows by slot (a random activation per slot)
    a = x if gated else (torch.randn(num_slots, weight.qweight.shape[1] * 8, generator=gen)
                         * 0.1).to(x.dtype).to(device)
    out = torch.full((num_slots, n), float("nan"), dtype=x.dtype, device=device)
    moe_w4_gemv(a, weight, out, sorted_slots, block_expert, num_slots, n, top_k, gated=gated,
                by_token=gated, block_m=block_m, split=split)
    flat = ids.reshape(-1).tolist()
    for slot, e in enumerate(flat):
        row = a[slot // top_k if gated else slot][None]
        y = w4a16_matmul_ref(row.float(), w4.expert("w13" if gated else "w2", e)).float()
        want = torch.nn.functional.silu(y[:, :n]) * y[:, n:] if gated else y
        assert rel_err(out[slot:slot + 1], want) < bound, (slot, e)
