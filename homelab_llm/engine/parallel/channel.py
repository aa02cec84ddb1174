"""Tensor parallelism: how rank 0's per-step plan reaches the other ranks.

The plan is int64 words (a PlanHeader, then one flat payload built on the host), never pickled:
on one node it crosses through a shared-memory ring (ring.py), across nodes as two tensors
over a gloo group. The same channel carries the rare gloo collectives (page count, memory split,
the shutdown barriers). Under async scheduling the payload ends with a patch section, and the
previous step's tokens follow the plan as one broadcast.
"""

from __future__ import annotations

import datetime
import os
from typing import Callable

import torch
import torch.distributed as dist

from homelab_llm.engine.args import EngineArgs, EngineArgsError
from homelab_llm.engine.parallel.ring import ShmRing, shm_available
from homelab_llm.engine.runner import MemorySplit, ModelRunner
from homelab_llm.engine.step_plan import HEADER_LEN, PlanHeader, StepBatch

MEMORY_FIELDS = ("total", "weights", "activations_peak", "graphs", "kv_cache", "state", "other", "free")
# The per-step plan's transport on one node: "shm" (default) or "gloo" (always across nodes).
PLAN_TRANSPORT_ENV = "HOMELAB_LLM_TP_PLAN"


class PlanChannel:
    """The plan over gloo broadcasts (works across nodes), plus the rare gloo collectives."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def barrier(self, timeout_s: float) -> None:
        """Every rank reached this point; raises if one did not within timeout_s."""
        dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=timeout_s))

    def close(self) -> None:
        pass

    def send(self, header: PlanHeader, payload: torch.Tensor | None = None,
             timeout: float | None = None) -> None:
        """`payload` holds header.payload_len words (none for a command without one)."""
        dist.broadcast(torch.tensor(header.to_words(), dtype=torch.long), src=0, group=self.group)
        if header.payload_len:
            dist.broadcast(payload, src=0, group=self.group)

    def recv(self) -> tuple[PlanHeader, torch.Tensor]:
        words = torch.empty(HEADER_LEN, dtype=torch.long)
        dist.broadcast(words, src=0, group=self.group)
        header = PlanHeader.from_words(words.tolist())
        payload = torch.empty(header.payload_len, dtype=torch.long)
        if header.payload_len:
            dist.broadcast(payload, src=0, group=self.group)
        return header, payload

    def min_all(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t)

    def gather_memory(self, m: MemorySplit) -> list[list[int]]:
        mine = torch.tensor([getattr(m, f) for f in MEMORY_FIELDS], dtype=torch.long)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, mine, group=self.group)
        return [p.tolist() for p in parts]


class ShmPlanChannel(PlanChannel):
    """The plan through a shared-memory ring (one node); gloo still carries the rare collectives.
    Rank 0 writes; local rank r reads as reader r - 1."""

    def __init__(self, group: dist.ProcessGroup, ring: ShmRing,
                 peers_alive: Callable[[], bool] | None = None) -> None:
        super().__init__(group)
        self.ring = ring
        self.peers_alive = peers_alive

    def send(self, header: PlanHeader, payload: torch.Tensor | None = None,
             timeout: float | None = None) -> None:
        h = torch.tensor(header.to_words(), dtype=torch.long)
        words = h if payload is None else torch.cat([h, payload])
        self.ring.write(words, self.peers_alive, timeout)

    def recv(self) -> tuple[PlanHeader, torch.Tensor]:
        words = self.ring.read()
        return PlanHeader.from_words(words[:HEADER_LEN].tolist()), words[HEADER_LEN:]

    def close(self) -> None:
        self.ring.close()
        self.peers_alive = None  # a bound method of the runner that owns this channel: no cycle


def open_channel(group: dist.ProcessGroup, ring: ShmRing | None,
                 peers_alive: Callable[[], bool] | None = None) -> PlanChannel:
    """The plan through `ring` when there is one, else over gloo."""
    return PlanChannel(group) if ring is None else ShmPlanChannel(group, ring, peers_alive)


def plan_transport(args: EngineArgs) -> str:
    """shm on one node (unless the env asks for gloo), gloo across nodes."""
    wanted = os.environ.get(PLAN_TRANSPORT_ENV, "shm")
    if wanted not in ("shm", "gloo"):
        raise EngineArgsError(f"{PLAN_TRANSPORT_ENV}={wanted!r}: use shm or gloo")
    return "shm" if wanted == "shm" and args.nnodes == 1 and shm_available() else "gloo"


def patch_section(plan_rows: list[int], pending_rows: list[int], num_tokens: int) -> torch.Tensor:
    """The payload tail of an async step: how many tokens rank 0 broadcasts after the plan, then
    which input rows take which of them."""
    return torch.tensor([num_tokens] + plan_rows + pending_rows, dtype=torch.long)


def receive_patch(section: list[int], batch: StepBatch, runner: ModelRunner) -> None:
    n, rows = section[0], section[1:]
    half = len(rows) // 2
    tokens = torch.empty(n, dtype=torch.long, device=runner.device)
    dist.broadcast(tokens, src=0)
    runner.patch_inputs(batch, rows[:half], rows[half:], tokens)
