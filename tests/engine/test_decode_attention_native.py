"""The CPU attention of a step's new tokens in one C call (kernels/decode_attention_native.py)
against torch: rotate-half RoPE, the cache store at each new token's slot, and SDPA over its
sequence's pages up to its own position, with GQA. fp32 throughout, the exponential a polynomial:
bound 1e-5 relative (Frobenius) on the output (observed ~1e-7), the stored k within 1e-5 of the
rotated one (FMA and norm rounding), v exact (the bias's sum within 1e-6), no other cache row
written; with the projection's bias (Qwen2) and per-head q / k RMSNorm (Qwen3) too. Head shapes (6 q / 2 kv x 64,
4 / 4 x 128, 16 / 1 x 32) and steps of one token after 0 to 599 positions (one chunk, several
merged by their maxima, the threaded split), a verify step's 5 tokens, a 7-token prompt, three
sequences' decode tokens and a mix of all: later rows of a sequence see its earlier ones and no
row sees past itself. Pages are shuffled and shared by no two sequences, so each row's page table
row is read, not assumed consecutive.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from homelab_llm.engine.kernels import decode_attention_native as native

PAGE = 4

pytestmark = pytest.mark.skipif(not native.available(6, 2, 64), reason="the C attention does not run here")


def _rotate(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_sin.chunk(2, -1)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)


STEPS = {  # each sequence: (positions already cached, new tokens)
    "first token": [(0, 1)],
    "decode 7": [(6, 1)],
    "decode 300": [(299, 1)],
    "decode 600": [(599, 1)],
    "verify 5": [(180, 5)],
    "prompt 7": [(0, 7)],
    "three sequences": [(10, 1), (40, 1), (300, 1)],
    "mixed": [(100, 3), (0, 4), (520, 1)],
}


# Every step on three head shapes; the extras (the projection's bias, Qwen2; each q / k head's
# RMSNorm before RoPE, Qwen3) on one shape's multi-row steps.
CASES = [(heads, step, "") for heads in [(6, 2, 64), (4, 4, 128), (16, 1, 32)] for step in STEPS] + [
    ((6, 2, 64), step, extras) for step in ("verify 5", "mixed") for extras in ("bias", "qk_norm", "bias+qk_norm")]


@pytest.mark.parametrize("heads,step,extras", CASES)
def test_matches_rotary_and_sdpa_over_shuffled_pages(heads, step, extras):
    HQ, HKV, D = heads  # noqa: N806 - the shapes' usual names
    seqs = STEPS[step]
    g = torch.Generator().manual_seed(len(step) * 7 + HQ)
    need = [(old + new + PAGE - 1) // PAGE for old, new in seqs]
    n_pages = sum(need) + 3
    k_cache = torch.randn(n_pages, PAGE, HKV, D, generator=g)
    v_cache = torch.randn(n_pages, PAGE, HKV, D, generator=g)
    order = torch.randperm(n_pages, generator=g).to(torch.int32)
    tables, at = [], 0
    for n in need:
        tables.append(order[at: at + n])
        at += n
    width = max(need) + 2
    page_table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        page_table[i, : len(t)] = t
    rows = sum(new for _, new in seqs)
    qkv = torch.randn(rows, (HQ + 2 * HKV) * D, generator=g) * 2
    angles = torch.rand(rows, D // 2, generator=g) * 6
    cos_sin = torch.cat((angles.cos(), angles.sin()), -1)
    scale = D ** -0.5
    slots, lens, owner = [], [], []
    for i, (old, new) in enumerate(seqs):
        for pos in range(old, old + new):
            slots.append(int(tables[i][pos // PAGE]) * PAGE + pos % PAGE)
            lens.append(pos + 1)
            owner.append(i)
    bias = torch.randn(qkv.shape[1], generator=g) if "bias" in extras else None
    norms = (torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5) if "qk_norm" in extras else None
    eps = 1e-6
    # the reference: bias, norms, rotate, store every row, then each row's SDPA over its rows so far
    x = qkv + bias if bias is not None else qkv
    q, k = x[:, : HQ * D].view(rows, HQ, D), x[:, HQ * D: (HQ + HKV) * D].view(rows, HKV, D)
    if norms is not None:
        q, k = F.rms_norm(q, (D,), norms[0], eps), F.rms_norm(k, (D,), norms[1], eps)
    q = _rotate(q, cos_sin.unsqueeze(1))
    k_new = _rotate(k, cos_sin.unsqueeze(1))
    v_new = x[:, (HQ + HKV) * D:].view(rows, HKV, D)
    k_ref, v_ref = k_cache.clone().view(-1, HKV, D), v_cache.clone().view(-1, HKV, D)
    k_ref[slots], v_ref[slots] = k_new, v_new
    want = torch.empty(rows, HQ * D)
    for r in range(rows):
        t = tables[owner[r]].long()
        cache_rows = (t.repeat_interleave(PAGE) * PAGE + torch.arange(PAGE).repeat(len(t)))[: lens[r]]
        keys = k_ref[cache_rows].transpose(0, 1).repeat_interleave(HQ // HKV, dim=0)  # [HQ, S, D]
        values = v_ref[cache_rows].transpose(0, 1).repeat_interleave(HQ // HKV, dim=0)
        want[r] = F.scaled_dot_product_attention(q[r].unsqueeze(1), keys, values, scale=scale).reshape(-1)
    out = torch.full((rows, HQ * D), float("nan"))
    info = native.row_info([new for _, new in seqs], [old + new for old, new in seqs], slots)
    pointers = {} if not extras else {
        "bias": None if bias is None else bias.data_ptr(),
        "q_norm": None if norms is None else norms[0].data_ptr(),
        "k_norm": None if norms is None else norms[1].data_ptr()}
    native.DecodeAttention(HQ, HKV, D, scale, eps)(qkv, cos_sin, k_cache, v_cache, page_table, info, out,
                                                   **pointers)
    assert float((out - want).norm() / want.norm()) < 1e-5
    assert torch.allclose(k_cache.view(-1, HKV, D)[slots], k_new, atol=1e-5, rtol=1e-5)
    assert torch.allclose(v_cache.view(-1, HKV, D)[slots], v_new, atol=1e-6, rtol=0) if bias is not None \
        else torch.equal(v_cache.view(-1, HKV, D)[slots], v_new)
    others = torch.ones(n_pages * PAGE, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(k_cache.view(-1, HKV, D)[others], k_ref[others])  # nothing else written
    assert torch.equal(v_cache.view(-1, HKV, D)[others], v_ref[others])


def test_row_info_counts_each_rows_positions():
    info = native.row_info([3, 1], [10, 4], [50, 51, 52, 7])
    assert list(info) == [0, 50, 8, 0, 51, 9, 0, 52, 10, 1, 7, 4]


def test_a_row_without_a_slot_is_refused_before_anything_is_written():
    k_cache, v_cache = torch.zeros(2, PAGE, 2, 64), torch.zeros(2, PAGE, 2, 64)
    qkv, out = torch.randn(2, 10 * 64), torch.zeros(2, 6 * 64)
    info = native.row_info([2], [2], [0, -1])
    with pytest.raises(ValueError, match="no cache slot"):
        native.DecodeAttention(6, 2, 64, 0.125)(qkv, torch.zeros(2, 64), k_cache, v_cache,
                                                torch.zeros(1, 2, dtype=torch.int32), info, out)
    assert not k_cache.any() and not v_cache.any() and not out.any()


def test_shapes_it_does_not_take_are_declined():
    assert not native.available(6, 2, 40)  # head dim not a multiple of 16
    assert not native.available(64, 2, 64)  # 32 query heads a KV head
    assert not native.available(6, 4, 64)  # heads not a multiple
