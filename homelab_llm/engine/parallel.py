"""Tensor-parallel process group: which rank this is, and the collectives layers call.

With one rank every collective is the identity, so single-device code pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1


_state = ParallelState()


def set_parallel_state(rank: int, world_size: int) -> None:
    global _state
    _state = ParallelState(rank, world_size)


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum across ranks in place (the row-parallel linear's output)."""
    if _state.world_size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dim (vocab-parallel logits)."""
    if _state.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
