"""Tensor parallelism: shutdown, in an order where nothing can wait forever (see `leave`).

Every rank finishes its GPU work and destroys its decode graphs (NCCL's teardown waits until every
graph that captured one of its collectives is gone), meets the others at a barrier, releases the
peer-mapped all-reduce buffers (unmap, barrier, free), then waits. Rank 0 aborts its communicators
(a local call, in a bounded thread) and only then tells the workers "done" through the rendezvous
store; they exit without any teardown of their own, so no rank's communicator ever sees a peer
vanish while it is still alive. A teardown that sticks anyway is recorded: exit stays clean and
the next engine in this process gets a clear error.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from homelab_llm.engine.faults import FatalEngineError
from homelab_llm.engine.parallel.channel import PlanChannel
from homelab_llm.engine.runner import ModelRunner

if TYPE_CHECKING:
    from homelab_llm.engine.parallel.comm import PeerAllReduce

log = logging.getLogger("homelab_llm.engine.parallel")

SHUTDOWN_WAIT_S = 10.0
DONE_KEY = "homelab_llm/tp_shutdown_done"  # rank 0 left its groups: workers may exit


class RankFailedError(FatalEngineError):
    """A tensor-parallel rank died or raised; the message carries that rank's error. Fatal: the
    engine is dead (engine/faults.py)."""


def _release_graphs(runner: ModelRunner) -> None:
    """Destroy the runner's decode graphs. NCCL's teardown (abort and destroy alike) polls until
    every CUDA graph that captured one of its collectives is destroyed, and the decode graphs hold
    the logits all-gather (and any all-reduce on the NCCL path): left alive they hang it, and
    when they are finally freed at interpreter exit the woken teardown thread aborts the process.
    The runner falls back to eager steps (there are none left: the engine is shutting down).
    An MTP model's head graphs hold the same all-gather: they go too."""
    runner.release_graphs()


def leave(channel: PlanChannel, runner: ModelRunner, comm: PeerAllReduce | None,
           device_type: str, wait_s: float) -> None:
    """Every rank's way out of a clean shutdown, before any process group is touched:
    1. this GPU is idle and its graphs destroyed;
    2. barrier: every rank is there, so no kernel anywhere reads or writes a peer's buffer or
       waits on a peer's flag any more;
    3. unmap the peers' buffers, barrier, free our own (only after every importer unmapped it).
    Barriers are bounded (raise after wait_s): a rank that died turns this into the unclean path."""
    if device_type == "cuda":
        torch.cuda.synchronize(runner.device)
    _release_graphs(runner)
    if device_type == "cuda":
        torch.cuda.synchronize(runner.device)
    channel.barrier(wait_s)
    if comm is not None:  # every GPU rank has one (maybe closed already), no CPU rank does
        comm.release_peers()
        channel.barrier(wait_s)
        comm.release_own()


def default_store() -> dist.Store | None:
    """The rendezvous store (its server lives in rank 0): carries rank 0's final "done"."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def wait_done(store: dist.Store | None, timeout_s: float) -> None:
    """A worker waits until rank 0 left its groups; rank 0 gone or late: leave anyway."""
    if store is None:
        return
    try:
        store.wait([DONE_KEY], datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # the store's server went with rank 0, or a timeout
        log.warning("no shutdown confirmation from rank 0 (%s); exiting", exc)


def _close_group(device_type: str) -> None:
    """Leave the process groups. On GPUs abort the communicators: a local call that waits on no
    peer (NCCL's graceful destroy is an intra-node collective), and with the graphs destroyed and
    the GPU idle nothing is left for it to wait on."""
    if not dist.is_initialized():
        return
    if device_type == "cuda":
        try:
            dist.distributed_c10d._abort_process_group()
            return
        except Exception as exc:  # an older torch: fall back to the graceful teardown
            log.warning("process group abort failed (%s); destroying instead", exc)
    dist.destroy_process_group()


# A teardown that did not finish in time (a graph this module does not know captured an NCCL
# collective, or a peer died with a kernel here waiting on it). Should never happen; if it does,
# exit stays clean and the next engine gets a clear error instead of torch's.
_stuck_teardowns: list[threading.Thread] = []


def teardown_groups(device_type: str, device: torch.device, runner: ModelRunner | None) -> None:
    """Rank 0 leaves its groups (in a bounded thread). `runner` on the unclean path only: its
    graphs go here, since with a peer dead even that can wait on the GPU."""
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if runner is not None:
        _release_graphs(runner)
    _close_group(device_type)


def note_stuck(thread: threading.Thread) -> None:
    if not _stuck_teardowns:
        atexit.register(_exit_guard)
    _stuck_teardowns.append(thread)


def _reset_all_graphs() -> None:
    graph_type = getattr(torch.cuda, "CUDAGraph", None)
    if graph_type is None:
        return
    gc.collect()
    for obj in gc.get_objects():
        if isinstance(obj, graph_type):
            obj.reset()


def _exit_guard(wait_s: float = 5.0) -> None:
    """At interpreter exit with a teardown thread still inside NCCL. Left alone, it wakes when
    finalization frees the last graphs, returns into a finalizing interpreter and is ended by
    pthread_exit, whose unwinding through torch's C++ frames aborts the process ("terminate
    called without an active exception", exit 134). So free every graph now, while Python still
    runs (atexit comes first), and let the thread finish; if it cannot, leave without
    finalization and say so (exit 1: the teardown failed)."""
    alive = [t for t in _stuck_teardowns if t.is_alive()]
    if not alive:
        return
    try:
        _reset_all_graphs()
    except Exception as exc:  # at exit: never raise
        log.warning("releasing CUDA graphs at exit: %s", exc)
    deadline = time.monotonic() + wait_s
    for t in alive:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in alive):
        print("homelab-llm: tensor-parallel teardown (NCCL) still stuck at exit; exiting without "
              "interpreter teardown", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def wait_for_stuck_teardown(timeout_s: float) -> None:
    """A new engine needs the previous one's groups gone (torch allows one default group)."""
    for t in list(_stuck_teardowns):
        t.join(timeout_s)
        if t.is_alive():
            raise RankFailedError("the previous tensor-parallel engine's NCCL teardown is still "
                                  "stuck in this process; start a new process")
        _stuck_teardowns.remove(t)
