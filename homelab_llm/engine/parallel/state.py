"""Tensor-parallel process group: which rank this is, and the collectives layers call.

With one rank every collective is the identity, so single-device code pays nothing. On GPUs of one
host with P2P, small all-reduces go through the one-shot kernel over peer-mapped buffers
(parallel/comm.py decides per message size); the rest through NCCL/RCCL (or gloo on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from homelab_llm.engine.parallel.comm import PeerAllReduce


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1
    peer_all_reduce: "PeerAllReduce | None" = None  # set up by comm.setup_all_reduce
    skip_all_reduce: bool = False  # HOMELAB_ALLREDUCE=none: benchmarks only, wrong results


_state = ParallelState()


def set_parallel_state(rank: int, world_size: int) -> None:
    """A new group: the previous group's peer buffers (if any) are released."""
    global _state
    if _state.peer_all_reduce is not None:
        _state.peer_all_reduce.close()
    _state = ParallelState(rank, world_size)


def set_all_reduce(peer: "PeerAllReduce | None", skip: bool = False) -> None:
    global _state
    _state = ParallelState(_state.rank, _state.world_size, peer, skip)


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum across ranks in place (the row-parallel linear's output)."""
    state = _state
    if state.world_size == 1 or state.skip_all_reduce:
        return x
    if state.peer_all_reduce is not None and state.peer_all_reduce.handles(x):
        return state.peer_all_reduce.all_reduce(x)
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dim (vocab-parallel logits)."""
    if _state.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
