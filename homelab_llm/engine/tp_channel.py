"""Tensor parallelism: how rank 0's per-step plan reaches the other ranks.

The plan is int64 words (a fixed header, then one flat payload built on the host), never pickled:
on one node it crosses through a shared-memory ring (step_channel.py), across nodes as two tensors
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
from homelab_llm.engine.runner import MemorySplit, ModelRunner
from homelab_llm.engine.scheduler import ScheduledSeq
from homelab_llm.engine.step_channel import ShmRing, shm_available
from homelab_llm.engine.step_plan import StepBatch, build_plan

CMD_STEP, CMD_PAGES, CMD_ALLOCATE, CMD_MEMORY, CMD_SHUTDOWN, CMD_GRAPHS = range(6)
HEADER = 10  # cmd, T, B, max_pages, n_logits, decode_only, max_q, max_s, arg, reserved
_MEM_FIELDS = ("total", "weights", "activations_peak", "graphs", "kv_cache", "state", "other", "free")
# The per-step plan's transport on one node: "shm" (default) or "gloo" (always across nodes).
PLAN_TRANSPORT_ENV = "HOMELAB_LLM_TP_PLAN"


class _Channel:
    """The plan over gloo broadcasts (works across nodes), plus the rare gloo collectives."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def barrier(self, timeout_s: float) -> None:
        """Every rank reached this point; raises if one did not within timeout_s."""
        dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=timeout_s))

    def close(self) -> None:
        pass

    def send(self, header: list[int], payload: torch.Tensor | None = None,
             timeout: float | None = None) -> None:
        h = torch.tensor(header + [0] * (HEADER - len(header)), dtype=torch.long)
        dist.broadcast(h, src=0, group=self.group)
        if payload is not None:
            dist.broadcast(payload, src=0, group=self.group)

    def recv_header(self) -> list[int]:
        h = torch.empty(HEADER, dtype=torch.long)
        dist.broadcast(h, src=0, group=self.group)
        return h.tolist()

    def recv_payload(self, n: int) -> torch.Tensor:
        p = torch.empty(n, dtype=torch.long)
        dist.broadcast(p, src=0, group=self.group)
        return p

    def min_all(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t)

    def gather_memory(self, m: MemorySplit) -> list[list[int]]:
        mine = torch.tensor([getattr(m, f) for f in _MEM_FIELDS], dtype=torch.long)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, mine, group=self.group)
        return [p.tolist() for p in parts]


class _ShmChannel(_Channel):
    """The plan through a shared-memory ring (one node); gloo still carries the rare collectives.
    Rank 0 writes; local rank r reads as reader r - 1."""

    def __init__(self, group: dist.ProcessGroup, ring: ShmRing,
                 peers_alive: Callable[[], bool] | None = None) -> None:
        super().__init__(group)
        self.ring = ring
        self.peers_alive = peers_alive
        self._payload: torch.Tensor | None = None

    def send(self, header: list[int], payload: torch.Tensor | None = None,
             timeout: float | None = None) -> None:
        h = torch.tensor(header + [0] * (HEADER - len(header)), dtype=torch.long)
        words = h if payload is None else torch.cat([h, payload])
        self.ring.write(words, self.peers_alive, timeout)

    def recv_header(self) -> list[int]:
        words = self.ring.read()
        self._payload = words[HEADER:]
        return words[:HEADER].tolist()

    def recv_payload(self, n: int) -> torch.Tensor:
        payload, self._payload = self._payload, None
        assert payload is not None and payload.numel() == n, "plan payload length mismatch"
        return payload

    def close(self) -> None:
        self.ring.close()
        self.peers_alive = None  # a bound method of the runner that owns this channel: no cycle


def _plan_transport(args: EngineArgs) -> str:
    """shm on one node (unless the env asks for gloo), gloo across nodes."""
    wanted = os.environ.get(PLAN_TRANSPORT_ENV, "shm")
    if wanted not in ("shm", "gloo"):
        raise EngineArgsError(f"{PLAN_TRANSPORT_ENV}={wanted!r}: use shm or gloo")
    return "shm" if wanted == "shm" and args.nnodes == 1 and shm_available() else "gloo"


def _plan(scheduled: list[ScheduledSeq], page_size: int, copies=None) -> tuple[list[int], torch.Tensor]:
    return build_plan(scheduled, page_size, CMD_STEP, copies)


def _unpack(header: list[int], payload: torch.Tensor, runner: ModelRunner) -> StepBatch:
    return runner.batch_from_plan(header, payload)


def _patch_section(plan_rows: list[int], pending_rows: list[int], num_tokens: int) -> torch.Tensor:
    """The payload tail of an async step: how many tokens rank 0 broadcasts after the plan, then
    which input rows take which of them."""
    return torch.tensor([num_tokens] + plan_rows + pending_rows, dtype=torch.long)


def _receive_patch(section: list[int], batch: StepBatch, runner: ModelRunner) -> None:
    n, rows = section[0], section[1:]
    half = len(rows) // 2
    tokens = torch.empty(n, dtype=torch.long, device=runner.device)
    dist.broadcast(tokens, src=0)
    runner.patch_inputs(batch, rows[:half], rows[half:], tokens)
