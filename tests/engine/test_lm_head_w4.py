"""--quantize-lm-head: the logits from a 4-bit copy of the LM head (layers/embedding.py
ParallelLMHead.quantize_w4), its flag, and the memory plan's count.

Bounds: the quantized head's logits equal hidden @ its dequantized weight (the CPU's exact
reference path) within 1e-5 relative; against the 16-bit head they move by the 4-bit
rounding: row-relative error under 0.15 for N(0, 1) weights (a group of 128 spans ~5 sigma, so
a step is ~0.35 sigma and the rounding ~0.1 sigma a weight, the noise every W4A16 linear
carries), where a wrong shard, group or transposition is of order 1 (~1.4).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from homelab_llm.engine import memory
from homelab_llm.engine.args import EngineArgs
from homelab_llm.engine.kernels.ref import dequantize_w4_ref
from homelab_llm.engine.layers.embedding import ParallelLMHead


def _head(vocab: int, hidden: int, seed: int) -> ParallelLMHead:
    head = ParallelLMHead(vocab, hidden)
    head.weight.data = torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(seed))
    return head


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


@pytest.mark.parametrize("hidden,group", [(256, 128), (576, 64)])  # SmolLM2's 576: groups of 64
def test_logits_from_the_4bit_copy(hidden: int, group: int) -> None:
    head = _head(1000, hidden, 1)
    dense = head.weight.data.clone()
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(2))
    want = head.compute_logits(x)
    head.quantize_w4(tied=False, rows=96)  # vocab rows a chunk: 11 chunks, the last short
    assert head.weight is None and head.w4.group_size == group and head.w4.int_zeros
    assert head.w4.out_features == 1000 and head.w4.in_features == hidden
    got = head.compute_logits(x)
    assert got.dtype == torch.float32 and got.shape == (3, 1000)
    exact = x @ dequantize_w4_ref(head.w4).float()
    assert _rel(got, exact) < 1e-5
    assert _rel(got, want) < 0.15
    whole = _head(1000, hidden, 1)
    whole.quantize_w4(tied=False, rows=1 << 20)  # one chunk: the same copy
    assert torch.equal(whole.w4.qweight, head.w4.qweight) and torch.equal(whole.w4.scales, head.w4.scales)
    buffers = sum(b.numel() * b.element_size() for b in head.buffers())
    assert buffers < dense.numel() * 2 // 3  # a quarter of bf16 plus the groups' scales and biases
    assert dense.shape == (1000, hidden)


def test_the_clip_search_rounds_closer() -> None:
    """quantize_rtn's clip search (the head's): no group's squared error above plain round to
    nearest's (1.0 is among the clips), the total ~10% below it on N(0, 1) rows."""
    from homelab_llm.engine.kernels.w4a16_pack import quantize_rtn
    from homelab_llm.engine.layers.embedding import HEAD_CLIPS

    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(4))

    def group_errors(clips: tuple[float, ...]) -> torch.Tensor:
        err = (dequantize_w4_ref(quantize_rtn(w, 128, False, clips)).float().t() - w).square()
        return err.view(256, 4, 128).sum(-1)

    plain, searched = group_errors((1.0,)), group_errors(HEAD_CLIPS)
    assert bool((searched <= plain * (1 + 1e-6)).all())
    assert float(searched.sum()) < 0.95 * float(plain.sum())


def test_a_tied_head_keeps_the_embeddings_weight() -> None:
    head = _head(64, 128, 3)
    head.quantize_w4(tied=True)
    assert head.weight is not None and head.w4 is not None
    with pytest.raises(ValueError, match="multiple of 32"):
        _head(64, 40, 3).quantize_w4(tied=False)


def test_flag_and_memory_plan() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli(parser.parse_args(["--quantize-lm-head"])).quantize_lm_head
    assert not EngineArgs.from_cli(parser.parse_args([])).quantize_lm_head
    from tests.engine.test_memory import LLAMA_3_1_8B, SMOLLM2_135M

    head = 128256 * 4096
    plain = memory.weight_bytes(LLAMA_3_1_8B, "bfloat16", "w4a16", 1)
    quant = memory.weight_bytes(LLAMA_3_1_8B, "bfloat16", "w4a16", 1, quantize_lm_head=True)
    assert plain - quant == head * 2 - (head // 2 + 4096 // 128 * 128256 * 4)
    tied = memory.weight_bytes(SMOLLM2_135M, "bfloat16", None, 1, quantize_lm_head=True)
    # the tied head's 4-bit copy comes on top (groups of 64 at hidden 576)
    assert tied - memory.weight_bytes(SMOLLM2_135M, "bfloat16", None, 1) == 49152 * 576 // 2 + 9 * 49152 * 4
    plan = memory.plan(LLAMA_3_1_8B, gpu_memory_bytes=24 << 30, quantization="w4a16", quantize_lm_head=True)
    assert plan.per_device[0].weights_bytes == quant


def test_a_checkpoints_4bit_head_takes_this_ranks_vocab_shard() -> None:
    """install_w4 (a quantized checkpoint's head, kept 4-bit): each of 2 ranks takes its vocab
    columns, the last padded with zero columns, so its logits are the full head's slice (and 0
    in the padding); the 16-bit weight goes."""
    from homelab_llm.engine.kernels.w4a16_pack import quantize_rtn
    from homelab_llm.engine.parallel import state as parallel

    full = quantize_rtn(torch.randn(1001, 128, generator=torch.Generator().manual_seed(5)), 128, False)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(6))
    want = x @ dequantize_w4_ref(full).float()
    try:
        for rank in (0, 1):
            parallel.set_parallel_state(rank, 2)
            head = ParallelLMHead(1001, 128)
            head.install_w4(full)
            assert head.weight is None and head.w4.out_features == head.shard_size == 501
            n = head.vocab_end - head.vocab_start
            logits = x @ dequantize_w4_ref(head.w4).float()
            assert torch.allclose(logits[:, :n], want[:, head.vocab_start:head.vocab_end], rtol=1e-5, atol=1e-5)
            assert not logits[:, n:].any()
    finally:
        parallel.set_parallel_state(0, 1)
    with pytest.raises(ValueError, match="1001 outputs"):
        ParallelLMHead(1000, 128).install_w4(full)
