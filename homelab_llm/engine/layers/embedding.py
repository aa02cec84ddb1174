"""Vocab-parallel token embedding and LM head.

Each rank holds a contiguous slice of the vocabulary, padded so every rank's slice has the same
length (the padding rows are zero and their logits are cut off after the gather).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.parallel.state import all_gather_last_dim, all_reduce, tp_rank, tp_size
from homelab_llm.engine.sharding import padded_shard


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.vocab_size = vocab_size
        self.vocab_start, self.shard_size = padded_shard(vocab_size, self.tp_size, self.tp_rank)
        self.vocab_end = min(self.vocab_start + self.shard_size, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.gguf_blocks: dict = {}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"vocab {loaded.shape[0]} does not match the config's {self.vocab_size}")
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded[self.vocab_start : self.vocab_end])
        param.data[n:].zero_()

    def record_gguf_blocks(self, blocks, shard_id=None) -> None:
        self.gguf_blocks[shard_id] = (blocks, slice(self.vocab_start, self.vocab_end), slice(None))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(in_shard, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out)


HEAD_CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8)  # quantize_w4's range search (w4a16_pack.quantize_rtn)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> float32 logits over the full vocabulary. With tied embeddings the model points
    this layer's weight at the embedding's parameter instead of loading its own.

    On the CPU's quantized default the head also keeps an int8 copy (kernels/int8_cpu.py, a
    quarter of the fp32 bytes: the head is the largest single read of a small model's decode
    step) and computes the logits from it; the dense weight stays for the embedding lookup.
    On a GPU, --quantize-lm-head gives it a 4-bit copy instead (quantize_w4), and an untied head
    drops its 16-bit weight."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.cpu_int8: Any = None
        self.w4: Any = None  # kernels.w4a16_pack.W4Weight of the vocab shard [hidden, shard]

    def quantize_w4(self, tied: bool, rows: int = 4096) -> None:
        """Compute the logits from a 4-bit copy of this rank's shard (round to nearest, asymmetric,
        each group's range clipped where that rounds it closer: ~10% less squared error on
        Gaussian rows; 128 inputs a group, or 64 / 32 where the hidden size asks) from now on,
        quantized `rows` vocab rows at a time (an fp32 copy of a 248K x 5120 head would be 5 GB).
        tied: the weight is the embedding's and stays; otherwise it goes."""
        from homelab_llm.engine.kernels.w4a16_pack import W4Weight, quantize_rtn

        hidden = self.weight.shape[1]
        group = next((g for g in (128, 64, 32) if hidden % g == 0), 0)
        if not group:
            raise ValueError(f"--quantize-lm-head: hidden size {hidden} is not a multiple of 32")
        parts = [quantize_rtn(self.weight.data[i:i + rows], group, symmetric=False, clips=HEAD_CLIPS)
                 for i in range(0, self.weight.shape[0], rows)]
        w4 = W4Weight(*(torch.cat([getattr(p, n) for p in parts], dim=1) for n in ("qweight", "scales", "biases")),
                      group, int_zeros=all(p.int_zeros for p in parts))  # each chunk's repack checked its own
        self._use_w4(w4, keep_weight=tied)

    def install_w4(self, w4: Any) -> None:
        """A checkpoint's 4-bit head (GPTQ / AutoRound / AWQ with a quantized lm_head, untied),
        kept 4-bit instead of dequantized: this rank's vocab columns, padded with zero columns to
        the shard's length (their logits are cut off after the gather); the 16-bit weight goes."""
        from homelab_llm.engine.kernels.w4a16_pack import W4Weight

        if w4.out_features != self.vocab_size:
            raise ValueError(f"4-bit lm_head has {w4.out_features} outputs, the vocab is {self.vocab_size}")
        n = self.vocab_end - self.vocab_start
        part = w4.narrow_out(self.vocab_start, n)
        pad = self.shard_size - n
        if pad:
            cols = [(t, torch.zeros((t.shape[0], pad), dtype=t.dtype, device=t.device))
                    for t in (part.qweight, part.scales, part.biases)]
            part = W4Weight(*(torch.cat(c, dim=1) for c in cols), part.group_size, part.perm,
                            int_zeros=part.int_zeros)
        self._use_w4(part, keep_weight=False)

    def _use_w4(self, w4: Any, keep_weight: bool) -> None:
        for name in ("qweight", "scales", "biases", "perm"):  # registered: memory accounting counts them
            self.register_buffer(f"w4_{name}", getattr(w4, name), persistent=False)
        self.w4 = w4
        if not keep_weight:
            self.weight = None

    def quantize_for_cpu(self) -> bool:
        """Build the int8 copy from the loaded weight; False (nothing done) where the kernel
        cannot take this shape or the weight is not on the CPU."""
        from homelab_llm.engine.kernels import int8_cpu

        if self.weight.device.type != "cpu" or not int8_cpu.supports(self.weight):
            return False
        self.cpu_int8 = int8_cpu.quantize_int8_for_cpu(self.weight)
        # Registered so memory accounting counts them.
        self.register_buffer("cpu_int8_packed", self.cpu_int8.packed, persistent=False)
        self.register_buffer("cpu_int8_scales", self.cpu_int8.scales_and_zeros, persistent=False)
        native = self.cpu_int8.native
        self.register_buffer("cpu_int8_native", None if native is None else native.blocks, persistent=False)
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.cpu_int8 is not None and hidden.device.type == "cpu":
            logits = dispatch.int8_logits(hidden, self.cpu_int8, self.weight)
        elif self.w4 is not None:
            logits = dispatch.w4a16_matmul(hidden, self.w4)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits)[..., : self.vocab_size]
        return logits.float()
