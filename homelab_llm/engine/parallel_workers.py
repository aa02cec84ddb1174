"""Tensor parallelism: one process per rank; rank 0 schedules and broadcasts each step's plan.

Rank 0 lives in the engine's process and drives ranks 1..N-1 (spawned here, or started on other
nodes with --node-rank). The plan is int64 words (a fixed header, then one flat payload built on
the host), never pickled: on one node it crosses through a shared-memory ring (step_channel.py),
across nodes as two tensors over a gloo group. Every rank then runs the same forward and its
collectives (NCCL/RCCL on GPUs, gloo on the CPU). A rank that raises or dies stops the whole
service: rank 0 logs that rank's error and exits non-zero, and workers die with rank 0 (no orphans).
Shutdown, in an order where nothing can wait forever (see `_leave`): every rank finishes its GPU
work and destroys its decode graphs (NCCL's teardown waits until every graph that captured one of
its collectives is gone), meets the others at a barrier, releases the peer-mapped all-reduce
buffers (unmap, barrier, free), then waits. Rank 0 aborts its communicators (a local call) and only
then tells the workers "done" through the rendezvous store; they exit without any teardown of
their own, so no rank's communicator ever sees a peer vanish while it is still alive.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import gc
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from homelab_llm.engine.args import EngineArgs, EngineArgsError
from homelab_llm.engine.cache.page_pool import PagePool
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.parallel import set_parallel_state
from homelab_llm.engine.runner import MemorySplit, ModelRunner
from homelab_llm.engine.step_plan import StepBatch, build_plan
from homelab_llm.engine.scheduler import ScheduledSeq
from homelab_llm.engine.step_channel import ShmRing, shm_available
from homelab_llm.errors import HomelabError

if TYPE_CHECKING:
    from homelab_llm.engine.comm import PeerAllReduce

log = logging.getLogger("homelab_llm.engine.parallel")

CMD_STEP, CMD_PAGES, CMD_ALLOCATE, CMD_MEMORY, CMD_SHUTDOWN, CMD_GRAPHS = range(6)
HEADER = 10  # cmd, T, B, max_pages, n_logits, decode_only, max_q, max_s, arg, reserved
_MEM_FIELDS = ("total", "weights", "activations_peak", "graphs", "kv_cache", "other", "free")
# The per-step plan's transport on one node: "shm" (default) or "gloo" (always across nodes).
PLAN_TRANSPORT_ENV = "HOMELAB_LLM_TP_PLAN"
SHUTDOWN_WAIT_S = 10.0
DONE_KEY = "homelab_llm/tp_shutdown_done"  # rank 0 left its groups: workers may exit


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """Sizes that work: any N up to num_kv_heads (uneven splits are fine); above that, N must
    divide num_attention_heads and be a multiple of num_kv_heads (KV heads are replicated)."""
    sizes = list(range(1, config.num_key_value_heads + 1))
    for n in range(config.num_key_value_heads + 1, config.num_attention_heads + 1):
        if config.num_attention_heads % n == 0 and n % config.num_key_value_heads == 0:
            sizes.append(n)
    return sizes


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    valid = valid_tp_sizes(config)
    if tp_size not in valid:
        raise EngineArgsError(
            f"--tensor-parallel-size {tp_size} cannot split {config.num_attention_heads} query / "
            f"{config.num_key_value_heads} KV heads; valid sizes: {', '.join(map(str, valid))}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the process that started us dies, so no worker is orphaned."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _device_for(device_type: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")


@dataclass
class _Launch:
    args: EngineArgs
    config: ModelConfig
    model_path: str
    device_type: str
    dtype: torch.dtype
    world_size: int
    init_method: str
    plan_ring: str | None = None  # the shared-memory ring's path when the plan crosses through it


def _init_group(launch: _Launch, rank: int) -> tuple[dist.ProcessGroup, PeerAllReduce | None]:
    """The process group, and on GPUs this rank's peer-buffer all-reduce (kept for shutdown)."""
    backend = "nccl" if launch.device_type == "cuda" else "gloo"
    if launch.device_type == "cuda":
        torch.cuda.set_device(_device_for("cuda", rank % max(1, torch.cuda.device_count())))
    dist.init_process_group(backend, init_method=launch.init_method, rank=rank,
                            world_size=launch.world_size, timeout=datetime.timedelta(minutes=10))
    set_parallel_state(rank, launch.world_size)
    # The plan always crosses on the CPU, so ranks get host-side lengths without a device sync.
    group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    comm = None
    if backend == "nccl":  # small all-reduces over peer-mapped buffers where P2P works
        from homelab_llm.engine.comm import setup_all_reduce

        comm = setup_all_reduce(group)
    return group, comm


class RankFailedError(HomelabError, RuntimeError):
    """A tensor-parallel rank died or raised; the message carries that rank's error."""


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


def _release_graphs(runner: ModelRunner) -> None:
    """Destroy the runner's decode graphs. NCCL's teardown (abort and destroy alike) polls until
    every CUDA graph that captured one of its collectives is destroyed, and the decode graphs hold
    the logits all-gather (and any all-reduce on the NCCL path): left alive they hang it, and
    when they are finally freed at interpreter exit the woken teardown thread aborts the process.
    The runner falls back to eager steps (there are none left: the engine is shutting down)."""
    graphs, runner.graphs = runner.graphs, None
    if graphs is not None:
        graphs.release()


def _leave(channel: _Channel, runner: ModelRunner, comm: PeerAllReduce | None,
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


def _default_store() -> dist.Store | None:
    """The rendezvous store (its server lives in rank 0): carries rank 0's final "done"."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _wait_done(store: dist.Store | None, timeout_s: float) -> None:
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


def _plan(scheduled: list[ScheduledSeq], page_size: int) -> tuple[list[int], torch.Tensor]:
    return build_plan(scheduled, page_size, CMD_STEP)


def _pack(batch: StepBatch) -> tuple[list[int], torch.Tensor]:
    c = batch.context
    b, max_pages = c.page_table.shape
    parts = [batch.input_ids, c.positions, c.slot_mapping, c.query_start_loc, c.seq_lens,
             c.page_table.reshape(-1), batch.logits_indices]
    payload = torch.cat([p.to("cpu", torch.long) for p in parts])
    header = [CMD_STEP, batch.num_tokens, b, max_pages, batch.logits_indices.numel(),
              int(c.decode_only), c.max_query_len, c.max_seq_len, payload.numel(), 0]
    return header, payload


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


def _worker_loop(launch: _Launch, rank: int, local_rank: int) -> None:
    group, comm = _init_group(launch, rank)
    if launch.plan_ring is not None:
        channel: _Channel = _ShmChannel(group, ShmRing.attach(launch.plan_ring, local_rank - 1))
    else:
        channel = _Channel(group)
    dist.barrier(group=group)  # every reader mapped the ring: rank 0 may unlink its name
    runner = ModelRunner(launch.args, launch.config, launch.model_path,
                         _device_for(launch.device_type, local_rank), launch.dtype,
                         tp_rank=rank, tp_size=launch.world_size)
    while True:
        header = channel.recv_header()
        cmd = header[0]
        if cmd == CMD_STEP:
            payload = channel.recv_payload(header[8])
            patch_len = header[9]
            batch = _unpack(header, payload[:header[8] - patch_len], runner)
            if patch_len:  # async scheduling: the previous step's tokens, from rank 0
                _receive_patch(payload[header[8] - patch_len:].tolist(), batch, runner)
            runner.forward(batch)
        elif cmd == CMD_PAGES:
            channel.min_all(runner.pages_for_budget(runner.kv_budget()))
        elif cmd == CMD_ALLOCATE:
            runner.allocate_pages(header[8])
        elif cmd == CMD_MEMORY:
            runner.refresh_memory()
            channel.gather_memory(runner.memory)
        elif cmd == CMD_GRAPHS:
            runner.capture_graphs(header[8])
        elif cmd == CMD_SHUTDOWN:
            break
    _leave(channel, runner, comm, launch.device_type, SHUTDOWN_WAIT_S)
    # No teardown here: this process's exit releases its communicators. It only has to outlive
    # rank 0's, so that no live communicator on rank 0 sees this rank vanish.
    _wait_done(_default_store(), SHUTDOWN_WAIT_S)
    channel.close()


def _worker_main(launch: _Launch, rank: int, local_rank: int, errors: "mp.Queue[str]") -> None:
    _die_with_parent()
    logging.basicConfig(level=logging.INFO)
    try:
        _worker_loop(launch, rank, local_rank)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip interpreter teardown: graphs and communicators go with the process
    except BaseException as exc:  # report every failure to rank 0, then exit non-zero
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        errors.close()
        errors.join_thread()  # the queue's feeder thread must flush before we exit
        sys.stderr.flush()
        os._exit(1)


# A teardown that did not finish in time (a graph this module does not know captured an NCCL
# collective, or a peer died with a kernel here waiting on it). Should never happen; if it does,
# exit stays clean and the next engine gets a clear error instead of torch's.
_stuck_teardowns: list[threading.Thread] = []


def _teardown(device_type: str, device: torch.device, runner: ModelRunner | None) -> None:
    """Rank 0 leaves its groups (in a bounded thread). `runner` on the unclean path only: its
    graphs go here, since with a peer dead even that can wait on the GPU."""
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if runner is not None:
        _release_graphs(runner)
    _close_group(device_type)


def _note_stuck(thread: threading.Thread) -> None:
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


def _wait_for_stuck_teardown(timeout_s: float) -> None:
    """A new engine needs the previous one's groups gone (torch allows one default group)."""
    for t in list(_stuck_teardowns):
        t.join(timeout_s)
        if t.is_alive():
            raise RankFailedError("the previous tensor-parallel engine's NCCL teardown is still "
                                  "stuck in this process; start a new process")
        _stuck_teardowns.remove(t)


class ParallelRunner:
    """Rank 0's runner: the same interface as ModelRunner, driving every rank in lockstep."""

    def __init__(self, args: EngineArgs, config: ModelConfig, model_path: str,
                 device: torch.device, dtype: torch.dtype) -> None:
        world = args.tensor_parallel_size
        check_tp_size(config, world)
        if args.nnodes < 1 or world % args.nnodes:
            raise EngineArgsError(
                f"--tensor-parallel-size {world} must be a multiple of --nnodes {args.nnodes}")
        if device.type == "cuda" and torch.cuda.device_count() < world // args.nnodes:
            raise EngineArgsError(
                f"--tensor-parallel-size {world} over {args.nnodes} node(s) needs "
                f"{world // args.nnodes} GPUs here, found {torch.cuda.device_count()}")
        _wait_for_stuck_teardown(SHUTDOWN_WAIT_S)
        port = args.master_port or _free_port()
        per_node = world // args.nnodes
        ring = (ShmRing.create(readers=per_node - 1) if _plan_transport(args) == "shm" else None)
        self.launch = _Launch(args, config, model_path, device.type, dtype, world,
                              f"tcp://{args.master_addr}:{port}", ring.path if ring else None)
        self.page_size = args.page_size
        self._ctx = mp.get_context("spawn")
        self._errors: mp.Queue[str] = self._ctx.Queue()
        self._closing = False
        self._stop = threading.Event()  # wakes the monitor at shutdown
        self._comm: PeerAllReduce | None = None
        self.shutdown_seconds = 0.0
        self.shutdown_phases: dict[str, float] = {}
        self.failure: str | None = None
        self.procs = [self._ctx.Process(target=_worker_main, args=(self.launch, r, r, self._errors),
                                        daemon=True) for r in range(1, per_node)]
        for p in self.procs:
            p.start()
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()
        try:
            group, self._comm = _init_group(self.launch, 0)
            if ring is not None:
                self.channel: _Channel = _ShmChannel(group, ring, self._peers_alive)
            else:
                self.channel = _Channel(group)
            dist.barrier(group=group)
        finally:
            if ring is not None:
                ring.unlink()  # mapped by every rank now (or never will be): no name to leak
        self._planned: tuple[StepBatch, list[int], torch.Tensor] | None = None
        self._patch: tuple[list[int], list[int], torch.Tensor] | None = None
        self.local = ModelRunner(args, config, model_path, device, dtype, tp_rank=0, tp_size=world)
        self.device = self.local.device
        self.pool: PagePool | None = None
        self._splits: list[MemorySplit] = []

    # Every rank must agree on the page count, so rank 0 takes the minimum of what each can hold.
    def kv_budget(self) -> int:
        self.channel.send([CMD_PAGES])
        pages = self.channel.min_all(self.local.pages_for_budget(self.local.kv_budget()))
        return pages * self.local.kv_layout().bytes_per_page()

    def allocate_kv(self, budget: int) -> PagePool:
        pages = self.local.pages_for_budget(budget)
        self.channel.send([CMD_ALLOCATE, 0, 0, 0, 0, 0, 0, 0, pages])
        self.pool = self.local.allocate_pages(pages)
        return self.pool

    def capture_graphs(self, max_model_len: int) -> None:
        self.channel.send([CMD_GRAPHS, 0, 0, 0, 0, 0, 0, 0, max_model_len])
        self.local.capture_graphs(max_model_len)

    def prepare(self, scheduled: list[ScheduledSeq]) -> StepBatch:
        # Rank 0 builds its batch from the same host-side plan the workers get: no device
        # round trip to pack it, and every rank's batch comes from the same words.
        header, payload = _plan(scheduled, self.page_size)
        batch = _unpack(header, payload, self.local)
        self._planned = (batch, header, payload)
        return batch

    def patch_inputs(self, batch: StepBatch, plan_rows: list[int], pending_rows: list[int],
                     tokens: torch.Tensor) -> None:
        """Async scheduling: rank 0 patches its own inputs now; the other ranks get the tokens by
        a broadcast right after this step's plan (forward), then patch theirs the same way."""
        self.local.patch_inputs(batch, plan_rows, pending_rows, tokens)
        self._patch = (plan_rows, pending_rows, tokens)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        planned, self._planned = self._planned, None
        patch, self._patch = self._patch, None
        if planned is not None and planned[0] is batch:
            header, payload = list(planned[1]), planned[2]
        else:  # a batch built elsewhere
            header, payload = _pack(batch)
        if patch is not None:
            section = _patch_section(patch[0], patch[1], patch[2].numel())
            payload = torch.cat([payload, section])
            header[8], header[9] = payload.numel(), section.numel()
        try:
            self.channel.send(header, payload)
            if patch is not None:
                dist.broadcast(patch[2].contiguous(), src=0)
            return self.local.forward(batch)
        except RuntimeError as exc:  # a peer vanished mid-collective
            raise self._failed(exc) from exc

    def refresh_memory(self) -> None:
        self.channel.send([CMD_MEMORY])
        self.local.refresh_memory()
        rows = self.channel.gather_memory(self.local.memory)
        splits = []
        for rank, row in enumerate(rows):
            name = (torch.cuda.get_device_name(rank % torch.cuda.device_count())
                    if self.device.type == "cuda" else "cpu")
            splits.append(MemorySplit(f"{name} (rank {rank})", **dict(zip(_MEM_FIELDS, row))))
        self._splits = splits

    @property
    def memory(self) -> MemorySplit:
        return self.local.memory

    def memory_splits(self) -> list[MemorySplit]:
        return self._splits or [self.local.memory]

    def _peers_alive(self) -> bool:
        return self.failure is None and all(p.exitcode is None for p in self.procs)

    def _watch(self) -> None:
        """Notice a dead rank, log its error, stop the others. Rank 0's pending collective then
        fails and raises RankFailedError; if it hangs instead (NCCL can), exit after a grace."""
        while not self._stop.is_set():
            dead = [(r, p) for r, p in enumerate(self.procs, start=1) if p.exitcode is not None]
            if dead:
                rank, proc = dead[0]
                try:
                    detail = self._errors.get(timeout=2.0)
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
            self._stop.wait(0.2)

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
        self._planned = self._patch = None
        self._comm = None
        self.pool = None
        if not stuck:
            self.local.release()

    def shutdown(self) -> None:
        """Returns in a fraction of a second on a clean run (see `_leave` for the order); a dead or
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

        store = _default_store()  # held past the teardown: its server is in this process
        clean = self.failure is None
        try:
            if clean:
                self.channel.send([CMD_SHUTDOWN], timeout=SHUTDOWN_WAIT_S)
                _leave(self.channel, self.local, self._comm, self.device.type, SHUTDOWN_WAIT_S)
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
            target=_teardown, name="tp-teardown", daemon=True,
            args=(self.device.type, self.device, None if clean else self.local))
        teardown.start()
        teardown.join(SHUTDOWN_WAIT_S)
        if teardown.is_alive():
            _note_stuck(teardown)
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


def run_worker_node(args: EngineArgs, config: ModelConfig, model_path: str,
                    device_type: str, dtype: torch.dtype) -> int:
    """A node other than node 0: run this node's ranks until rank 0 says shut down.

    Same flags as node 0 plus --node-rank; rendezvous at --master-addr:--master-port (env://
    style, torchrun-compatible numbering: global rank = node_rank * ranks_per_node + local)."""
    world = args.tensor_parallel_size
    if not args.master_port:
        raise EngineArgsError("--node-rank > 0 needs --master-port (and --master-addr) of node 0")
    per_node = world // args.nnodes
    launch = _Launch(args, config, model_path, device_type, dtype, world,
                     f"tcp://{args.master_addr}:{args.master_port}")
    ctx = mp.get_context("spawn")
    errors: mp.Queue[str] = ctx.Queue()
    first = args.node_rank * per_node
    procs = [ctx.Process(target=_worker_main, args=(launch, first + i, i, errors), daemon=True)
             for i in range(per_node)]
    for p in procs:
        p.start()
    code = 0
    for p in procs:
        p.join()
        code = code or (p.exitcode or 0)
    if code:
        try:
            print(f"homelab-llm: worker failed: {errors.get(timeout=1)}", file=sys.stderr)
        except Exception:
            pass
    return code


def serve_worker_node(args: EngineArgs) -> int:
    """Entry for `--node-rank N` (N > 0): resolve the model like node 0 does, then run this
    node's ranks until node 0 shuts them down. Returns the exit code."""
    from homelab_llm.engine.core import resolve_device, resolve_dtype, resolve_model_path
    from homelab_llm.engine.model.loader import (load_model_config, resolve_format,
                                                 resolve_quantization)

    args.validate()
    model_path = resolve_model_path(args.model)
    device = resolve_device(args.device)
    config = load_model_config(model_path, args.load_format)
    check_tp_size(config, args.tensor_parallel_size)
    quantization = resolve_quantization(config, resolve_format(model_path, args.load_format),
                                        args.quantization)
    dtype = resolve_dtype(args.dtype, device, quantization)
    return run_worker_node(args, config, model_path, device.type, dtype)
