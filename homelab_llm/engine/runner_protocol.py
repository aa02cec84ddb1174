"""Runner: what the engine loop (core.LLMEngine) asks of a runner, declared once.

ModelRunner (engine/runner.py, one device) and ParallelRunner (engine/parallel/runner.py, rank 0
driving every tensor-parallel rank) both satisfy it; core.py holds one and never checks which.
tests/test_architecture.py checks that both classes define every member.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from homelab_llm.engine.cache.copies import CacheCopies
    from homelab_llm.engine.cache.page_pool import PagePool
    from homelab_llm.engine.runner import MemorySplit
    from homelab_llm.engine.scheduler import ScheduledSeq
    from homelab_llm.engine.step_plan import PlanHeader, StepBatch


class Runner(Protocol):
    device: torch.device
    failure: str | None  # why the runner cannot step any more (a rank died), else None

    @property
    def memory(self) -> MemorySplit: ...

    # Hybrid models: (running, snapshot) state slots the runner allocated; (0, 0) otherwise.
    def state_slot_counts(self) -> tuple[int, int]: ...

    # Start-up, in this order: how many KV bytes fit, take them, capture decode graphs.
    def kv_budget(self) -> int: ...
    def allocate_kv(self, budget: int) -> PagePool: ...
    def capture_graphs(self, max_model_len: int) -> None: ...

    # One step: batch tensors from the schedule (and the cache copies every rank runs first),
    # async placeholders filled, logits of sampled rows.
    def prepare(self, scheduled: list[ScheduledSeq], copies: CacheCopies | None = None) -> StepBatch: ...
    def patch_inputs(self, batch: StepBatch, plan_rows: list[int], pending_rows: list[int],
                     tokens: torch.Tensor) -> None: ...
    def forward(self, batch: StepBatch) -> torch.Tensor: ...
    # MTP models: one head forward on every rank (spec/mtp_draft.py), argmax tokens per row (on
    # the device); a chain step (step > 0) takes its input tokens from the previous forward's.
    def run_mtp(self, plan: tuple[PlanHeader, torch.Tensor], hidden_rows: list[int],
                step: int) -> torch.Tensor: ...

    # Reporting (/v1/status) and the end: shutdown gives back every device resource. Idempotent.
    def refresh_memory(self) -> None: ...
    def memory_splits(self) -> list[MemorySplit]: ...
    def shutdown(self) -> None: ...
