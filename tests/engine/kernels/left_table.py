"""The interpreter's table patched to route 3-16 rows to the few-row W4A16 left-operand kernel
(kernels/w4a16_dot.py), for tests that run the GPU path on CPU tensors through the interpreter;
a model's linears as 4-bit weights, a 4-row decode context, a tiny hybrid set up for it."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from homelab_llm.engine.kernels import tuning
from homelab_llm.engine.kernels import w4a16_pack as wp

# the layer tests run the GPU path on CPU tensors through the interpreter, on its patched table
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the GPU path through the Triton interpreter (CPU only)")


def use_left_table(monkeypatch, x_pairs: bool) -> None:
    """The interpreter's table routing 3-16 rows to the left-operand kernel on 16 x 64 tiles
    in the integer-zero form, reading x in pair order or not."""
    tiles = tuning.GemmTiles(16, 64, 128, num_warps=4, num_stages=2, split_k=4, int_zeros=True,
                             x_pairs=x_pairs)
    monkeypatch.setitem(tuning.W4A16_ROUTES, "interpret", ((2, "h2"), (16, "dotL"), (1 << 62, "deq")))
    monkeypatch.setitem(tuning.TABLE, "interpret", dataclasses.replace(
        tuning.TABLE["interpret"], w4a16_dot_left=((16, tiles),), w4a16_dot_left_thin=()))


def w4_linears(model, skip: tuple[str, ...] = ()) -> None:
    """Every linear of model as a W4A16 weight with integer zero points, but those named in skip
    (kept bf16): group 128, or 32 where the input is narrower (the eight-dot loop, k order)."""
    from homelab_llm.engine.layers.linear import LinearBase

    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and module.weight is not None and not name.endswith(skip):
            group = 128 if module.weight.shape[1] % 128 == 0 else 32
            module.set_w4(wp.quantize_rtn(module.weight.data.float(), group, False))


def w4_gated_mlp(hidden: int, inter: int, gen: torch.Generator):
    """(norm, gate_up, down): an RMSNorm (weights in [0.5, 1.5)) and a merged gate | up and a down
    projection as random W4A16 weights (group 128, scaled by 1 / sqrt(fan-in))."""
    from homelab_llm.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from homelab_llm.engine.layers.norm import RMSNorm

    norm = RMSNorm(hidden)
    norm.weight.data = (torch.rand(hidden, generator=gen) + 0.5).to(torch.bfloat16)
    gate_up, down = MergedColumnParallelLinear(hidden, [inter, inter]), RowParallelLinear(inter, hidden)
    for lin in (gate_up, down):
        lin.set_w4(wp.quantize_rtn(torch.randn(lin.weight.shape, generator=gen) * lin.weight.shape[-1] ** -0.5,
                                   128, False))
    return norm, gate_up, down


def four_rows_context(**extra):
    """4 sequences decoding their 6th token (pages 2s and 2s + 1 of size 4; KV split in 2)."""
    from homelab_llm.engine.context import ForwardContext

    return ForwardContext(
        positions=torch.full((4,), 5), slot_mapping=torch.tensor([4 * p + 1 for p in (1, 3, 5, 7)]),
        query_start_loc=torch.arange(5, dtype=torch.int32), seq_lens=torch.full((4,), 6, dtype=torch.int32),
        page_table=torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=torch.int32), max_query_len=1,
        max_seq_len=6, page_size=4, decode_only=True, query_lens_host=[1] * 4, seq_lens_host=[6] * 4,
        num_kv_splits=2, **extra)


def hybrid_w4_model(hidden: int, inter: int, seed: int, layer_types: tuple[str, ...] | None = None):
    """(model, config, context): a tiny W4A16 Qwen3.5 hybrid (launch_count.TINY_QWEN3_5's layers:
    3 Gated DeltaNet, 1 gated attention, or layer_types; value heads of 128) of that hidden and
    MLP size, its in_proj_ba kept bf16, random KV pages and states for 4 sequences decoding
    (four_rows_context with their state slots)."""
    from tests.engine.kernels.launch_count import TINY_QWEN3_5, tiny_decode_model

    types = layer_types or TINY_QWEN3_5.layer_types
    config = dataclasses.replace(TINY_QWEN3_5, hidden_size=hidden, intermediate_size=inter,
                                 linear_num_value_heads=2, linear_value_head_dim=128,
                                 num_hidden_layers=len(types), layer_types=tuple(types),
                                 name="tiny-w4-hybrid")
    model, _ = tiny_decode_model(torch.bfloat16, seed, config)
    w4_linears(model, skip=("in_proj_ba",))
    for attn in model.attention_layers:
        attn.k_cache, attn.v_cache = (torch.randn(8, 4, attn.num_kv_heads, attn.head_dim).to(torch.bfloat16)
                                      for _ in range(2))
    for gdn in model.gdn_layers:
        gdn.conv_state = torch.randn(4, config.linear_conv_kernel_dim - 1, gdn.conv_dim).to(torch.bfloat16)
        gdn.ssm_state = torch.randn(4, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim) * 0.1
    ctx = four_rows_context(state_indices=torch.arange(4, dtype=torch.int32),
                            has_initial_state=torch.ones(4, dtype=torch.bool))
    return model, config, ctx


def on_device(model, ctx, device: torch.device):
    """(model, ctx) moved to device: the parameters and buffers, the attention layers' K/V pages
    and the Gated DeltaNet layers' states (plain attributes), and every tensor of the context."""
    model = model.to(device)
    for attn in getattr(model, "attention_layers", []):
        attn.k_cache, attn.v_cache = attn.k_cache.to(device), attn.v_cache.to(device)
    for gdn in getattr(model, "gdn_layers", []):
        gdn.conv_state, gdn.ssm_state = gdn.conv_state.to(device), gdn.ssm_state.to(device)
    moved = {f.name: getattr(ctx, f.name).to(device) for f in dataclasses.fields(ctx)
             if isinstance(getattr(ctx, f.name), torch.Tensor)}
    return model, dataclasses.replace(ctx, **moved)
