"""Pair order written where the input is made (kernels/pair_order.py): the RMSNorm (with and
without its residual add, and with its rows in k order as well for a second reader), the
SiLU-and-mul and the decode attention's final store (o_proj's input) store their rows in the
few-row W4A16 left loop's pair order, and a table whose left-operand tiles read x so
(GemmTiles.x_pairs) gets a pre-norm linear's, a gated MLP's and o_proj's input from them,
with no reorder of its own: layer by layer and in whole decode steps of a tiny Llama and a
tiny Qwen3.5 hybrid.

Bounds: the producers' rows are the k-order rows moved, bit for bit (the same arithmetic, only
the store index differs). Through the layers, against the same table reading x in k order
(split in registers): row-relative 1e-2 on bf16 outputs (the integer-zero form's sums are the
same products in the same order; 1e-2 leaves room for a bf16 rounding flipped by a different
fp32 summation on a GPU), where x in the wrong order is of order 1.
"""

from __future__ import annotations

import os

import pytest
import torch

from homelab_llm.engine.kernels import dispatch, elementwise, tuning
from homelab_llm.engine.kernels import w4a16_dot as dot_mod
from homelab_llm.engine.kernels import w4a16_pack as wp
from homelab_llm.engine.kernels.pair_order import pair_check, pair_order
from tests.engine.kernels.left_table import (four_rows_context, hybrid_w4_model, interpreted, use_left_table,
                                             w4_linears)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_producers_write_pair_order(dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(51)
    x = torch.randn(3, 384, generator=gen).to(device, dtype)
    res = torch.randn(3, 384, generator=gen).to(device, dtype)
    w = (torch.rand(384, generator=gen) + 0.5).to(device)
    for block in (128, 384, 8):
        assert torch.equal(elementwise.rms_norm(x, w, 1e-6, pair_block=block),
                           pair_order(elementwise.rms_norm(x, w, 1e-6), block)), block
        normed, summed = elementwise.add_rms_norm(x, res, w, 1e-6, pair_block=block)
        want, want_sum = elementwise.add_rms_norm(x, res, w, 1e-6)
        assert torch.equal(normed, pair_order(want, block)) and torch.equal(summed, want_sum), block
        paired, summed, kept = elementwise.norm_rows(x, res, w, 1e-6, block, keep_k_order=True)
        assert torch.equal(paired, normed) and torch.equal(summed, want_sum) and torch.equal(kept, want)
    gate_up = torch.randn(2, 2 * 1536, generator=gen).to(device, dtype)  # two programs of 1024
    for block in (128, 512):
        assert torch.equal(elementwise.silu_and_mul(gate_up, pair_block=block),
                           pair_order(elementwise.silu_and_mul(gate_up), block)), block
    with pytest.raises(ValueError, match="whole K steps"):
        pair_check(384, 256)
    with pytest.raises(ValueError, match="whole K steps"):
        pair_check(384, 12)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_attention_output_written_in_pair_order(kv_dtype: torch.dtype, device: torch.device, paged_kv) -> None:
    """The decode attention's final store in o_proj's pair order, bit for bit the k-order output
    reordered: one split (the split kernel's store), four (the merge kernel's), the fused merge
    (the last split program's), each with and without the output gate (in the merge, or its
    own launch after one split), and verify groups of 2 rows; K steps of one head (32), two and
    four heads (a step across heads)."""
    import dataclasses as dc

    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(61)
    hq, hkv, d, lens = 4, 2, 32, [9, 5, 14, 14]
    k_cache, v_cache, ks, vs, table = paged_kv(lens, hkv, d, 4, kv_dtype, device, gen)
    table[3] = table[2]  # rows 2 and 3: one sequence's verify group (its last row sees 14 keys)
    sl = torch.tensor([9, 5, 13, 14], dtype=torch.int32, device=device)
    q = torch.randn(4, hq, d, generator=gen).to(device, torch.bfloat16)
    gate = (torch.randn(4, hq * 2 * d, generator=gen) * 3).to(device, torch.bfloat16).view(4, hq, 2 * d)[..., d:]
    qsl = torch.arange(5, dtype=torch.int32, device=device)
    fused = dc.replace(tuning.decode_tiles(device, kv_dtype == torch.int8), fused_merge=True)
    for splits, tiles, rows in ((1, None, 1), (4, None, 1), (4, fused, 1), (1, None, 2), (2, None, 2)):
        for g in (None, gate):
            kw = dict(num_splits=splits, tiles=tiles, rows_per_seq=rows, gate=g)
            want = paged_decode_attention(q, k_cache, v_cache, table, qsl, sl, 0.2, ks, vs, **kw)
            for block in (32, 64, 128):
                got = paged_decode_attention(q, k_cache, v_cache, table, qsl, sl, 0.2, ks, vs, pair_block=block, **kw)
                assert got.shape == want.shape and got.is_contiguous()
                assert torch.equal(got.view(4, -1), pair_order(want.reshape(4, -1), block)), \
                    (splits, tiles is fused, rows, g is None, block)
    with pytest.raises(ValueError, match="whole K steps"):
        paged_decode_attention(q, k_cache, v_cache, table, qsl, sl, 0.2, ks, vs, pair_block=256)


@pytest.mark.parametrize("kernels", [False, True])
def test_every_attention_route_hands_over_pair_order(kernels: bool, monkeypatch, paged_kv) -> None:
    """dispatch.paged_attention(pair_block=) on each route: the decode kernels (one-token rows)
    store pair order themselves; the extend kernel (rows of 3 and 2 new tokens) and the CPU
    reference reorder after; gated or not, each bit for bit the k-order output reordered."""
    if kernels and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the GPU routes through the Triton interpreter (CPU only)")
    monkeypatch.setattr(dispatch, "use_triton", lambda t: kernels)
    gen = torch.Generator().manual_seed(63)
    k_cache, v_cache, _, _, table = paged_kv([12, 7], 2, 32, 4, torch.bfloat16, torch.device("cpu"), gen)
    sl = torch.tensor([12, 7], dtype=torch.int32)
    for q_lens in ([1, 1], [3, 2]):
        t = sum(q_lens)
        q = torch.randn(t, 4, 32, generator=gen).to(torch.bfloat16)
        gate = torch.randn(t, 4, 32, generator=gen).to(torch.bfloat16)
        qsl = torch.tensor([0, q_lens[0], t], dtype=torch.int32)
        for g in (None, gate):
            def run(block: int) -> torch.Tensor:
                return dispatch.paged_attention(q, k_cache, v_cache, table, qsl, sl, 0.2, None, None, q_lens,
                                                [12, 7], gate=g, pair_block=block)

            want = run(0).reshape(t, -1)
            assert torch.equal(run(64).reshape(t, -1), pair_order(want, 64)), (q_lens, g is None)


HIDDEN, INTER, ROWS = 128, 256, 4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)).max())


def _mlp():
    from homelab_llm.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from homelab_llm.engine.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(53)
    norm = RMSNorm(HIDDEN)
    norm.weight.data = torch.rand(HIDDEN, generator=gen) + 0.5
    gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER])
    down = RowParallelLinear(INTER, HIDDEN)
    for lin in (gate_up, down):
        w = torch.randn(lin.weight.shape, generator=gen) * lin.weight.shape[-1] ** -0.5
        lin.set_w4(wp.quantize_rtn(w, 128, False))
        assert lin.w4.int_zeros
    return norm, gate_up, down


@interpreted
def test_norm_and_gated_mlp_feed_the_left_loop_in_pair_order(monkeypatch) -> None:
    from homelab_llm.engine.layers.norm_linear import gated_mlp, norm_then_linear

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)  # the GPU path, interpreted
    norm, gate_up, down = _mlp()
    gen = torch.Generator().manual_seed(55)
    x = torch.randn(ROWS, HIDDEN, generator=gen).to(torch.bfloat16)
    residual = torch.randn(ROWS, HIDDEN, generator=gen).to(torch.bfloat16)

    use_left_table(monkeypatch, x_pairs=False)  # x in k order: the left loop splits it in registers
    assert dispatch.w4a16_pairs_block(x, gate_up.w4) == 0
    want_h, want_res = norm_then_linear(x, residual, norm, gate_up)
    want_out = down(want_h, act_in="silu")
    want_first = norm_then_linear(x, None, norm, gate_up)[0]  # the first layer: no residual yet

    use_left_table(monkeypatch, x_pairs=True)
    assert dispatch.w4a16_pairs_block(x, gate_up.w4) == 128
    assert dispatch.w4a16_pairs_block(x[:2], gate_up.w4) == 0  # 2 rows: the packed-half GEMV

    def no_reorder(*args, **kwargs):
        raise AssertionError("the producer was to write pair order")

    monkeypatch.setattr(dot_mod, "pair_order", no_reorder)
    h, res = norm_then_linear(x, residual, norm, gate_up)
    assert torch.equal(res, want_res)
    assert _rel(h, want_h) < 1e-2
    out, res = gated_mlp(x, residual, norm, gate_up, down)
    assert torch.equal(res, want_res)
    assert _rel(out, want_out) < 1e-2
    first, same = norm_then_linear(x, None, norm, gate_up)
    assert same is x and _rel(first, want_first) < 1e-2


def _steps_in_both_orders(monkeypatch, model, ctx) -> tuple[list, tuple, tuple]:
    """(the weights w4a16_paired_matmul served, (launches, hidden) reading k order, the same with
    x_pairs on): one decode step of model each, from the same caches and states, on the
    interpreter's table patched to the left-operand kernel; the launch's own reorder fails."""
    import copy

    from homelab_llm.engine.context import forward_context
    from tests.engine.kernels.launch_count import count_calls

    from homelab_llm.engine.kernels import gdn

    from homelab_llm.engine.layers.norm_chain import CHAIN_ENV

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    monkeypatch.setattr(gdn, "use_triton", lambda t: True)  # the Gated DeltaNet kernels too
    monkeypatch.setenv(CHAIN_ENV, "0")  # the norms' own launches write the pair order here
    use_left_table(monkeypatch, x_pairs=False)
    ids = torch.tensor([3, 9, 27, 41])

    def step(env: str):
        monkeypatch.setenv(tuning.DOT_LEFT_ENV, env)
        with torch.no_grad(), forward_context(ctx):
            copy.deepcopy(model)(ids, ctx.positions)  # first-use buffers (GEMV tickets) outside the count
            fresh = copy.deepcopy(model)  # the caches and states as they were
            return count_calls(monkeypatch, lambda: fresh(ids, ctx.positions))

    paired: list = []
    real = dispatch.w4a16_paired_matmul
    monkeypatch.setattr(dispatch, "w4a16_paired_matmul", lambda x, w: paired.append(w) or real(x, w))
    k_order = step("")
    assert not paired
    monkeypatch.setattr(dot_mod, "pair_order", lambda *a, **k: pytest.fail("reordered at the launch"))
    return paired, k_order, step("x_pairs=1")


@interpreted
def test_llama_decode_step_with_producers_writing_pair_order(monkeypatch) -> None:
    """A tiny W4A16 Llama's decode step for 4 sequences (4 rows: the left-operand kernel on the
    patched table; the attention's merge writes o_proj's input) with x_pairs on
    (HOMELAB_LLM_DOT_LEFT) against the same step reading x in k order: the hidden rows within
    1e-2 (module docstring), the same launches (the producers' order costs none), and the
    launch's own reorder never runs."""
    from homelab_llm.engine.model.config import ModelConfig
    from homelab_llm.engine.model.llama import LlamaForCausalLM
    from tests.engine.kernels.launch_count import bind_cache, random_weights

    config = ModelConfig(architecture="llama", vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         name="tiny-w4")
    torch.manual_seed(57)
    model = random_weights(LlamaForCausalLM(config), 0.1).to(torch.bfloat16)
    w4_linears(model)
    for attn in model.attention_layers:
        bind_cache(attn, torch.bfloat16, pages=8)
    paired, (want_counts, want), (got_counts, got) = _steps_in_both_orders(monkeypatch, model,
                                                                           four_rows_context())
    # qkv_proj and gate_up_proj after their norms, o_proj after the attention's merge (4 heads of
    # 64: a K step across 2 heads), down_proj after the SiLU-and-mul, per layer, in the warm-up
    # and the counted step
    assert len(paired) == 2 * 4 * config.num_hidden_layers
    assert _rel(got, want) < 1e-2
    assert got_counts == want_counts, (got_counts, want_counts)


@interpreted
def test_hybrid_decode_step_with_producers_writing_pair_order(monkeypatch) -> None:
    """The same for a tiny W4A16 Qwen3.5 hybrid (a Gated DeltaNet layer, then a gated attention):
    a Gated DeltaNet layer's input norm writes its rows twice, in pair order for in_proj_qkvz
    and in k order for the bf16 in_proj_ba beside it (one launch, as before), and its decode
    kernel's gated norm writes out_proj's input in pair order (value heads of 128: one K step
    a head), as the gated attention's merge does o_proj's."""
    model, config, ctx = hybrid_w4_model(HIDDEN, INTER, 59, ("linear_attention", "full_attention"))
    paired, (want_counts, want), (got_counts, got) = _steps_in_both_orders(monkeypatch, model, ctx)
    # per layer gate_up and down; in_proj_qkvz and out_proj in the Gated DeltaNet layers,
    # qkv_proj and o_proj (after the gated merge) in the attention one; in the warm-up and the
    # counted step
    assert len(paired) == 2 * 4 * config.num_hidden_layers
    assert _rel(got, want) < 1e-2
    assert got_counts == want_counts, (got_counts, want_counts)
