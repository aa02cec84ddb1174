"""SplitTensor: one checkpoint tensor that holds several parts of one fused weight of ours.

Qwen3.5 stores Gated DeltaNet's q|k|v as one `in_proj_qkv` tensor, parts one after another.
Qwen3-Next fuses q|k|v|z (`in_proj_qkvz`) and b|a (`in_proj_ba`) and interleaves them per key
head: the rows are [head 0: q0 k0 v0 z0 | head 1: q1 k1 v1 z1 | ...] (transformers'
fix_query_key_value_ordering). `groups` says how many such blocks there are (1: plain parts).

Both the dense loader (loader.split_parts) and the 4-bit one (w4a16_checkpoint) cut a tensor
through `spans`, so the two layouts are one rule: each part is the concatenation of its row
spans, in group order, which is exactly our contiguous per-part layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SplitTensor:
    fused: str  # our fused module the parts load into (its part_ids are the part names)
    parts: tuple[tuple[str, int], ...]  # (part name, total rows of that part), in tensor order
    groups: int = 1  # >1: the parts interleave in this many equal blocks (one per key head)

    def __post_init__(self) -> None:
        bad = [name for name, size in self.parts if size % self.groups]
        if self.groups < 1 or bad:
            raise ValueError(f"{self.fused}: parts {bad} do not split into {self.groups} groups")

    @property
    def rows(self) -> int:
        return sum(size for _, size in self.parts)

    def spans(self) -> list[tuple[str, list[tuple[int, int]]]]:
        """Each part with its (start, length) row spans in the checkpoint tensor, in order."""
        block = self.rows // self.groups
        out, offset = [], 0
        for name, size in self.parts:
            n = size // self.groups
            out.append((name, [(g * block + offset, n) for g in range(self.groups)]))
            offset += n
        return out

    def take(self, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(part name, its rows) of a dense checkpoint tensor; its row count must be `rows`."""
        if tensor.shape[0] != self.rows:
            raise ValueError(f"{tensor.shape[0]} rows, expected {self.rows}")
        return [(name, torch.cat([tensor[s:s + n] for s, n in spans]))
                for name, spans in self.spans()]
