"""Vocab-parallel token embedding and LM head.

Each rank holds a contiguous slice of the vocabulary, padded so every rank's slice has the same
length (the padding rows are zero and their logits are cut off after the gather).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> float32 logits over the full vocabulary. With tied embeddings the model points
    this layer's weight at the embedding's parameter instead of loading its own."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits)[..., : self.vocab_size]
        return logits.float()
