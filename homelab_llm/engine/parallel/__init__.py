"""Tensor parallelism: one process per rank; rank 0 schedules and sends each step's plan.

Modules, by job:
  state.py     this rank and the world size; the collectives the layers call (all_reduce, ...)
  comm.py      the one-shot all-reduce over peer-mapped GPU buffers, and when to use it
  launch.py    what a spawned rank needs to start (launch spec, device, process group)
  ring.py      the shared-memory ring that carries the plan between the ranks of one node
  channel.py   the plan channel (the ring on one node, gloo across nodes) and its commands
  runner.py    ParallelRunner: rank 0's runner, driving every rank in lockstep
  worker.py    ranks 1..N-1: the loop that runs rank 0's plans; worker nodes (--node-rank)
  shutdown.py  the shutdown order and its bounded teardown

This package's face is what the engine and the CLI use: ParallelRunner, serve_worker_node,
RankFailedError. They load on first use (PEP 562): the layers import parallel/state.py, which
runs this file first, and rank 0's runner imports the model code that imports those layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from homelab_llm.engine.parallel.runner import ParallelRunner
    from homelab_llm.engine.parallel.shutdown import RankFailedError
    from homelab_llm.engine.parallel.worker import serve_worker_node

__all__ = ["ParallelRunner", "RankFailedError", "serve_worker_node"]


def __getattr__(name: str) -> Any:
    if name == "ParallelRunner":
        from homelab_llm.engine.parallel.runner import ParallelRunner

        return ParallelRunner
    if name == "RankFailedError":
        from homelab_llm.engine.parallel.shutdown import RankFailedError

        return RankFailedError
    if name == "serve_worker_node":
        from homelab_llm.engine.parallel.worker import serve_worker_node

        return serve_worker_node
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
