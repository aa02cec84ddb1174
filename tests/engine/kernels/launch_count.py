"""Count the kernel launches of one batch-1 decode step of a tiny Qwen3.5 hybrid, on the CPU.

The GPU path is taken (dispatch.use_triton forced true) with every Triton kernel interpreted
(TRITON_INTERPRET=1, set by conftest), so the count is what a GPU would launch: each Triton
kernel call, plus each aten op that runs a kernel (views, allocations and metadata ops do not).
The dense GEMV route is off for ordinary linears (they stand for the reference deployment's
W4A16 GEMVs) and on for in_proj_ba, the one narrow bf16 linear (here through
dispatch.SKINNY_GEMV_N; on sm_90 the table's 1-row route takes it). What the count cannot see:
BLAS internals (cuBLAS's split-K reduce is a second launch on the GPU; here a matmul counts once)
and the W4A16 linears (the tiny model is dense).

    TRITON_INTERPRET=1 python -m tests.engine.kernels.launch_count [--layers 64]

prints the count by kernel for TINY_QWEN3_5's widths with Qwen3.6-27B's 64 layers (every 4th one
full attention): the reference deployment's step minus lm_head and sampling, its 256 matmuls
standing for the W4A16 GEMVs (one launch each).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from homelab_llm.engine.context import ForwardContext, forward_context
from homelab_llm.engine.model.config import LAYER_FULL, LAYER_LINEAR, ModelConfig

# 3 Gated DeltaNet layers then 1 gated full-attention layer, as Qwen3.6-27B repeats them.
TINY_QWEN3_5 = ModelConfig(
    architecture="qwen3_5", vocab_size=64, hidden_size=64, intermediate_size=96,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    rope_theta=1e4, max_position_embeddings=64, qk_norm=True, torch_dtype="bfloat16",
    name="tiny-qwen3.5", layer_types=(LAYER_LINEAR,) * 3 + (LAYER_FULL,),
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
    attn_output_gate=True)
# aten ops that launch nothing: allocation and metadata.
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
              "detach", "alias", "_local_scalar_dense", "is_same_size", "sym_size", "sym_stride",
              "sym_numel", "sym_storage_offset", "resolve_conj", "resolve_neg", "_unsafe_view"}


class LaunchCounter(TorchDispatchMode):
    """Counts kernel-running aten ops by name (Triton launches are added by `count_launches`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in _NO_KERNEL:
            self.counts[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


def tiny_decode_model(dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                      config: ModelConfig = TINY_QWEN3_5, model_class=None):
    """`config` (TINY_QWEN3_5) with random weights, its KV pages and state slots bound, and the context of
    one sequence decoding its 6th token (state slot 1, pages 2 and 1 of size 4), its KV split
    in 2 as a decode graph fixes it (so the attention's merge kernel runs). model_class: a
    Qwen3.5 subclass (the MoE one), else Qwen3_5ForCausalLM."""
    from homelab_llm.engine.model.qwen3_5 import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    model = random_weights((model_class or Qwen3_5ForCausalLM)(config), 0.1).to(dtype)
    for attn in model.attention_layers:
        bind_cache(attn, dtype)
    for gdn in model.gdn_layers:
        gdn.conv_state = torch.randn(2, config.linear_conv_kernel_dim - 1, gdn.conv_dim).to(dtype)
        gdn.ssm_state = torch.randn(2, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim) * 0.1
    return model, decode_context(state_indices=torch.tensor([1], dtype=torch.int32),
                                 has_initial_state=torch.tensor([True]))


def random_weights(module, scale: float):
    """module with its norm weights in [0.5, 1.5) and every other parameter N(0, scale^2)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * scale)
    return module


def bind_cache(attn, dtype: torch.dtype, pages: int = 4, page_size: int = 4) -> None:
    """A random paged K/V cache bound to an Attention module: bf16/fp16 values, or int8 codes
    with fp16 scales of 0.01."""
    shape = (pages, page_size, attn.num_kv_heads, attn.head_dim)
    if dtype == torch.int8:
        attn.k_cache = torch.randint(-100, 100, shape, dtype=torch.int8)
        attn.v_cache = torch.randint(-100, 100, shape, dtype=torch.int8)
        attn.k_scale = torch.full(shape[:3], 0.01, dtype=torch.float16)
        attn.v_scale = torch.full(shape[:3], 0.01, dtype=torch.float16)
    else:
        attn.k_cache = torch.randn(shape).to(dtype)
        attn.v_cache = torch.randn(shape).to(dtype)


def decode_context(**extra) -> ForwardContext:
    """One sequence decoding its 6th token (slot 5: pages 2 then 1 of size 4), its KV split in 2
    as a decode graph fixes it (so the attention's merge kernel runs)."""
    return ForwardContext(
        positions=torch.tensor([5]), slot_mapping=torch.tensor([5]),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([6], dtype=torch.int32),
        page_table=torch.tensor([[2, 1]], dtype=torch.int32), max_query_len=1, max_seq_len=6,
        page_size=4, decode_only=True, query_lens_host=[1], seq_lens_host=[6], num_kv_splits=2,
        **extra)


def count_launches(monkeypatch, model, ctx, input_ids: torch.Tensor) -> tuple[Counter[str], torch.Tensor]:
    """(launches by kernel name, hidden) for model(input_ids) on the GPU path, interpreted."""
    from homelab_llm.engine.kernels import dispatch, gdn, tuning

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    monkeypatch.setattr(gdn, "use_triton", lambda t: True)
    # The tiny model's bf16 matmuls stand for the 27B's W4A16 GEMVs: the bf16 decode GEMV (on
    # for 1 row on sm_90) does not serve them there
    interp = tuning.DENSE_GEMV_TABLE["interpret"]
    monkeypatch.setitem(tuning.DENSE_GEMV_TABLE, "interpret", dataclasses.replace(interp, max_rows=0))
    # Every linear of the tiny model is narrow; of the real one's only in_proj_ba [2 * Hv] is.
    monkeypatch.setattr(dispatch, "SKINNY_GEMV_N", 2 * model.config.linear_num_value_heads)
    with torch.no_grad(), forward_context(ctx):  # first-use buffers (GEMV tickets) outside the count
        copy.deepcopy(model)(input_ids, ctx.positions)  # a copy: the model's caches stay as they are
    with forward_context(ctx):
        return count_calls(monkeypatch, lambda: model(input_ids, ctx.positions))


def count_calls(monkeypatch, fn):
    """(launches by kernel name, fn()): aten ops that run a kernel, and Triton launches through
    the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    counter = LaunchCounter()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        counter.counts[f"triton.{self.fn.__name__}"] += 1
        counter.paused = True  # the interpreter's own tensor traffic is not the kernel's
        try:
            return run(self, *args, **kwargs)
        finally:
            counter.paused = False

    with monkeypatch.context() as patch:
        patch.setattr(InterpretedFunction, "run", counted)
        with torch.no_grad(), counter:
            result = fn()
    return counter.counts, result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=64, help="layers, every 4th full attention")
    a = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("launch_count: run with TRITON_INTERPRET=1 (it counts interpreted launches)")
    import pytest

    config = dataclasses.replace(TINY_QWEN3_5, num_hidden_layers=a.layers, layer_types=tuple(
        LAYER_FULL if (i + 1) % 4 == 0 else LAYER_LINEAR for i in range(a.layers)))
    model, ctx = tiny_decode_model(config=config)
    with pytest.MonkeyPatch.context() as monkeypatch:
        counts, _ = count_launches(monkeypatch, model, ctx, torch.tensor([7]))
    for name, n in counts.most_common():
        print(f"{n:5d} {name}")
    print(f"{sum(counts.values()):5d} launches a decode step, {a.layers} layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
