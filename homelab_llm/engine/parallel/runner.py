"""Tensor parallelism: rank 0's runner. One process per rank; rank 0 schedules and broadcasts
each step's plan.

Rank 0 lives in the engine's process and drives ranks 1..N-1 (spawned here, or started on other
nodes with --node-rank: worker.py). The plan (channel.py) is int64 words, never pickled: on
one node it crosses through a shared-memory ring, across nodes as two tensors over a gloo group.
Every rank then runs the same forward and its collectives (NCCL/RCCL on GPUs, gloo on the CPU). A
rank that raises or dies stops the whole service: rank 0 logs that rank's error and exits
non-zero, and workers die with rank 0 (no orphans). Shutdown: shutdown.py has the order.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import threading
import time
from dataclasses import replace
from multiprocessing.connection import wait as wait_for_any
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from homelab_llm.engine.args import EngineArgs, EngineArgsError
from homelab_llm.engine.cache.copies import CacheCopies
from homelab_llm.engine.cache.page_pool import PagePool
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.parallel.channel import (MEMORY_FIELDS, open_channel, patch_section,
                                                 plan_transport)
from homelab_llm.engine.parallel.launch import LaunchSpec, check_tp_flag, init_group, rendezvous_url
from homelab_llm.engine.parallel.ring import ShmRing
from homelab_llm.engine.parallel.shutdown import (DONE_KEY, SHUTDOWN_WAIT_S, RankFailedError,
                                                  default_store, leave, note_stuck,
                                                  teardown_groups, wait_for_stuck_teardown)
from homelab_llm.engine.parallel.state import set_parallel_state
from homelab_llm.engine.parallel.worker import worker_main
from homelab_llm.engine.runner import MemorySplit, ModelRunner
from homelab_llm.engine.scheduler import ScheduledSeq
from homelab_llm.engine.step_plan import (CMD_ALLOCATE, CMD_GRAPHS, CMD_MEMORY, CMD_MTP, CMD_PAGES,
                                          CMD_SHUTDOWN, PlanHeader, StepBatch)

if TYPE_CHECKING:
    from homelab_llm.engine.parallel.comm import PeerAllReduce

log = logging.getLogger("homelab_llm.engine.parallel")


class ParallelRunner:
    """Rank 0's runner, driving every rank in lockstep. A Runner (runner_protocol.py), as
    ModelRunner is: the engine loop holds either one."""

    def __init__(self, args: EngineArgs, config: ModelConfig, model_path: str,
                 device: torch.device, dtype: torch.dtype) -> None:
        world = args.tensor_parallel_size
        check_tp_flag(config, world)
        if args.nnodes < 1 or world % args.nnodes:
            raise EngineArgsError(
                f"--tensor-parallel-size {world} must be a multiple of --nnodes {args.nnodes}")
        if device.type == "cuda" and torch.cuda.device_count() < world // args.nnodes:
            raise EngineArgsError(
                f"--tensor-parallel-size {world} over {args.nnodes} node(s) needs "
                f"{world // args.nnodes} GPUs here, found {torch.cuda.device_count()}")
        wait_for_stuck_teardown(SHUTDOWN_WAIT_S)
        per_node = world // args.nnodes
        ring = (ShmRing.create(readers=per_node - 1) if plan_transport(args) == "shm" else None)
        self.launch = LaunchSpec(args, config, model_path, device.type, dtype, world,
                              rendezvous_url(args), ring.path if ring else None)
        self.page_size = args.page_size
        self._ctx = mp.get_context("spawn")
        self._errors: mp.Queue[str] = self._ctx.Queue()
        self._closing = False
        self._stop = threading.Event()  # wakes the monitor at shutdown
        self._comm: PeerAllReduce | None = None
        self.shutdown_seconds = 0.0
        self.shutdown_phases: dict[str, float] = {}
        self.failure: str | None = None
        self.procs = [self._ctx.Process(target=worker_main, args=(self.launch, r, r, self._errors),
                                        daemon=True) for r in range(1, per_node)]
        for p in self.procs:
            p.start()
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()
        try:
            group, self._comm = init_group(self.launch, 0)
            self.channel = open_channel(group, ring, self._peers_alive)
            dist.barrier(group=group)
        finally:
            if ring is not None:
                ring.unlink()  # mapped by every rank now (or never will be): no name to leak
        self.local = ModelRunner(args, config, model_path, device, dtype, tp_rank=0, tp_size=world)
        self.device = self.local.device
        self.pool: PagePool | None = None
        self._splits: list[MemorySplit] = []

    # Every rank must agree on the page count, so rank 0 takes the minimum of what each can hold.
    def kv_budget(self) -> int:
        self.channel.send(PlanHeader(CMD_PAGES))
        pages = self.channel.min_all(self.local.pages_for_budget(self.local.kv_budget()))
        return self.local.kv_bytes_for_pages(pages)

    def allocate_kv(self, budget: int) -> PagePool:
        pages = self.local.pages_for_budget(budget)
        self.channel.send(PlanHeader(CMD_ALLOCATE, arg=pages))
        self.pool = self.local.allocate_pages(pages)
        return self.pool

    def capture_graphs(self, max_model_len: int) -> None:
        self.channel.send(PlanHeader(CMD_GRAPHS, arg=max_model_len))
        self.local.capture_graphs(max_model_len)

    def prepare(self, scheduled: list[ScheduledSeq], copies: CacheCopies | None = None) -> StepBatch:
        # Rank 0 builds its batch from the same host-side plan the workers get: no device
        # round trip to pack it, and every rank's batch comes from the same words (the cache
        # copies included, so every rank copies the same KV rows and state slots).
        return self.local.batch_from_plan(*self.local.checked_plan(scheduled, copies))

    def state_slot_counts(self) -> tuple[int, int]:
        return self.local.state_slot_counts()

    def patch_inputs(self, batch: StepBatch, plan_rows: list[int], pending_rows: list[int],
                     tokens: torch.Tensor) -> None:
        """Async scheduling: rank 0 patches its own inputs now; the other ranks get the tokens by
        a broadcast right after this step's plan (forward), then patch theirs the same way."""
        self.local.patch_inputs(batch, plan_rows, pending_rows, tokens)
        batch.patch = (plan_rows, pending_rows, tokens)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        if batch.plan is None:
            raise ValueError("a tensor-parallel step must come from prepare(): its plan goes to every rank")
        header, payload = batch.plan
        patch = batch.patch
        if patch is not None:
            section = patch_section(patch[0], patch[1], patch[2].numel())
            payload = torch.cat([payload, section])
            header = replace(header, payload_len=payload.numel(), patch_len=section.numel())
        try:
            self.channel.send(header, payload)
            if patch is not None:
                dist.broadcast(patch[2].contiguous(), src=0)
            return self.local.forward(batch)
        except RuntimeError as exc:  # a peer vanished mid-collective
            raise self._failed(exc) from exc

    def run_mtp(self, plan: tuple[PlanHeader, torch.Tensor], hidden_rows: list[int],
                step: int) -> torch.Tensor:
        """Every rank runs the same MTP head forward: the plan, then the hidden rows."""
        header, payload = plan
        rows = torch.tensor(hidden_rows, dtype=torch.long)
        payload = torch.cat([payload, rows])
        try:
            self.channel.send(replace(header, cmd=CMD_MTP, payload_len=payload.numel(),
                                      patch_len=rows.numel(), arg=step), payload)
            return self.local.run_mtp(plan, hidden_rows, step)
        except RuntimeError as exc:  # a peer vanished mid-collective
            raise self._failed(exc) from exc

    def refresh_memory(self) -> None:
        self.channel.send(PlanHeader(CMD_MEMORY))
        self.local.refresh_memory()
        rows = self.channel.gather_memory(self.local.memory)
        splits = []
        for rank, row in enumerate(rows):
            name = (torch.cuda.get_device_name(rank % torch.cuda.device_count())
                    if self.device.type == "cuda" else "cpu")
            splits.append(MemorySplit(f"{name} (rank {rank})", **dict(zip(MEMORY_FIELDS, row))))
        self._splits = splits

    @property
    def memory(self) -> MemorySplit:
        return self.local.memory

    def memory_splits(self) -> list[MemorySplit]:
        return self._splits or [self.local.memory]

    def _peers_alive(self) -> bool:
        return self.failure is None and all(p.exitcode is None for p in self.procs)

    def _watch(self) -> None:
        """Notice a dead rank the moment its process ends (its sentinel), log its error, stop
        the others. `failure` makes the engine dead (core.LLMEngine.dead_reason), idle or not;
        rank 0's pending collective then fails and raises RankFailedError; if it hangs instead
        (NCCL can), exit after a grace."""
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        while not self._stop.is_set():
            ended = wait_for_any(list(sentinels), timeout=0.2)
            if ended and not self._stop.is_set():
                rank, proc = sentinels[ended[0]]
                proc.join(1.0)  # reap it: its exit code is known once the sentinel fired
                try:  # a rank that raised sent its traceback before exiting
                    detail = self._errors.get(timeout=0.5)
                except Exception:
                    detail = f"rank {rank} exited with code {proc.exitcode}"
                self.failure = detail
                log.error("tensor-parallel worker failed, stopping: %s", detail)
                print(f"homelab-llm: tensor-parallel worker failed: {detail}", file=sys.stderr,
                      flush=True)
                for q in self.procs:
                    if q.is_alive():
                        q.kill()
                if not self._stop.wait(10.0):
                    os._exit(1)
                return

    def _failed(self, exc: BaseException) -> "RankFailedError":
        deadline = time.monotonic() + 3.0
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return RankFailedError(f"tensor parallelism stopped: {self.failure or exc}")

    def _kill_workers(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()

    def _release(self, stuck: bool) -> None:
        """Let go of everything that holds device memory, so that dropping the engine gives it
        all back without waiting for the cycle collector: the monitor thread (its frame holds
        this runner) has ended, and the weights, KV cache and peer all-reduce go now. A teardown
        still stuck may be using rank 0's runner: that one is left to it (the process must be
        restarted anyway)."""
        self._monitor.join(SHUTDOWN_WAIT_S)
        self._comm = None
        self.pool = None
        if not stuck:
            self.local.release()

    def shutdown(self) -> None:
        """Returns in a fraction of a second on a clean run (see `leave` for the order); a dead or
        stuck peer costs at most a few bounded waits, and never a hang at exit."""
        if self._closing:
            return
        self._closing = True
        self._stop.set()
        start = mark = time.monotonic()
        phases: dict[str, float] = {}

        def lap(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            phases[name], mark = now - mark, now

        store = default_store()  # held past the teardown: its server is in this process
        clean = self.failure is None
        try:
            if clean:
                self.channel.send(PlanHeader(CMD_SHUTDOWN), timeout=SHUTDOWN_WAIT_S)
                leave(self.channel, self.local, self._comm, self.device.type, SHUTDOWN_WAIT_S)
        except Exception as exc:  # a dead peer: fall through to killing
            clean = False
            log.warning("tensor-parallel shutdown barrier failed: %s", exc)
        lap("leave")
        if not clean:
            self._kill_workers()
            if self._comm is not None:
                self._comm.abandon()  # a kernel here may wait on the dead peer: no GPU call
        # A local abort, bounded all the same: should it ever stick, shutdown still returns.
        teardown = threading.Thread(
            target=teardown_groups, name="tp-teardown", daemon=True,
            args=(self.device.type, self.device, None if clean else self.local))
        teardown.start()
        teardown.join(SHUTDOWN_WAIT_S)
        if teardown.is_alive():
            note_stuck(teardown)
            log.warning("process group teardown did not finish in %.0f s; continuing",
                        SHUTDOWN_WAIT_S)
        lap("teardown")
        if store is not None:
            try:
                store.set(DONE_KEY, "1")  # workers may exit now
            except Exception as exc:
                log.warning("telling the workers to exit: %s", exc)
        for p in self.procs:
            p.join(timeout=SHUTDOWN_WAIT_S)
        self._kill_workers()
        lap("workers")
        del store
        self.channel.close()
        set_parallel_state(0, 1)
        self._release(stuck=teardown.is_alive())
        self.shutdown_phases = phases
        self.shutdown_seconds = time.monotonic() - start
        log.info("tensor parallelism shut down in %.2f s (%s)", self.shutdown_seconds,
                 ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
