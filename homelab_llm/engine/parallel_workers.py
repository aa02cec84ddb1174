"""Tensor parallelism: one process per rank; rank 0 schedules and broadcasts each step's plan.

Rank 0 lives in the engine's process and drives ranks 1..N-1 (spawned here, or started on other
nodes with --node-rank). The plan crosses as two int64 tensors over a gloo group (a fixed header,
then one flat payload), never pickled; every rank then runs the same forward and its collectives
(NCCL/RCCL on GPUs, gloo on the CPU). A rank that raises or dies stops the whole service: rank 0
logs that rank's error and exits non-zero, and workers die with rank 0 (no orphans).
"""

from __future__ import annotations

import ctypes
import datetime
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

import torch
import torch.distributed as dist

from homelab_llm.engine.args import EngineArgs, EngineArgsError
from homelab_llm.engine.cache.page_pool import PagePool
from homelab_llm.engine.context import ForwardContext
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.parallel import set_parallel_state
from homelab_llm.engine.runner import MemorySplit, ModelRunner, StepBatch
from homelab_llm.engine.scheduler import ScheduledSeq
from homelab_llm.errors import HomelabError

log = logging.getLogger("homelab_llm.engine.parallel")

CMD_STEP, CMD_PAGES, CMD_ALLOCATE, CMD_MEMORY, CMD_SHUTDOWN, CMD_GRAPHS = range(6)
HEADER = 10  # cmd, T, B, max_pages, n_logits, decode_only, max_q, max_s, arg, reserved
_MEM_FIELDS = ("total", "weights", "activations_peak", "graphs", "kv_cache", "other", "free")


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


def _init_group(launch: _Launch, rank: int) -> dist.ProcessGroup:
    backend = "nccl" if launch.device_type == "cuda" else "gloo"
    if launch.device_type == "cuda":
        torch.cuda.set_device(_device_for("cuda", rank % max(1, torch.cuda.device_count())))
    dist.init_process_group(backend, init_method=launch.init_method, rank=rank,
                            world_size=launch.world_size, timeout=datetime.timedelta(minutes=10))
    set_parallel_state(rank, launch.world_size)
    # The plan always crosses on the CPU, so ranks get host-side lengths without a device sync.
    return dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


class RankFailedError(HomelabError, RuntimeError):
    """A tensor-parallel rank died or raised; the message carries that rank's error."""


class _Channel:
    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def send(self, header: list[int], payload: torch.Tensor | None = None) -> None:
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


def _pack(batch: StepBatch) -> tuple[list[int], torch.Tensor]:
    c = batch.context
    b, max_pages = c.page_table.shape
    parts = [batch.input_ids, c.positions, c.slot_mapping, c.query_start_loc, c.seq_lens,
             c.page_table.reshape(-1), batch.logits_indices]
    payload = torch.cat([p.to("cpu", torch.long) for p in parts])
    header = [CMD_STEP, batch.num_tokens, b, max_pages, batch.logits_indices.numel(),
              int(c.decode_only), c.max_query_len, c.max_seq_len, payload.numel()]
    return header, payload


def _unpack(header: list[int], payload: torch.Tensor, runner: ModelRunner) -> StepBatch:
    _, t, b, max_pages, n_logits, decode_only, max_q, max_s, _n, _ = header
    sizes = [t, t, t, b + 1, b, b * max_pages, n_logits]
    ids, pos, slots, qsl, lens, table, logits_idx = torch.split(payload, sizes)
    dev = runner.device
    starts = qsl.tolist()
    ctx = ForwardContext(
        positions=pos.to(dev), slot_mapping=slots.to(dev),
        query_start_loc=qsl.to(dev, torch.int32), seq_lens=lens.to(dev, torch.int32),
        page_table=table.view(b, max_pages).to(dev, torch.int32),
        max_query_len=max_q, max_seq_len=max_s, page_size=runner.page_size,
        decode_only=bool(decode_only),
        query_lens_host=[starts[i + 1] - starts[i] for i in range(b)], seq_lens_host=lens.tolist())
    return StepBatch(input_ids=ids.to(dev), positions=ctx.positions,
                     logits_indices=logits_idx.to(dev), context=ctx, num_tokens=t)


def _worker_loop(launch: _Launch, rank: int, local_rank: int) -> None:
    group = _init_group(launch, rank)
    channel = _Channel(group)
    runner = ModelRunner(launch.args, launch.config, launch.model_path,
                         _device_for(launch.device_type, local_rank), launch.dtype,
                         tp_rank=rank, tp_size=launch.world_size)
    while True:
        header = channel.recv_header()
        cmd = header[0]
        if cmd == CMD_STEP:
            batch = _unpack(header, channel.recv_payload(header[8]), runner)
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
    dist.destroy_process_group()


def _worker_main(launch: _Launch, rank: int, local_rank: int, errors: "mp.Queue[str]") -> None:
    _die_with_parent()
    logging.basicConfig(level=logging.INFO)
    try:
        _worker_loop(launch, rank, local_rank)
    except BaseException as exc:  # report every failure to rank 0, then exit non-zero
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        errors.close()
        errors.join_thread()  # the queue's feeder thread must flush before we exit
        sys.stderr.flush()
        os._exit(1)


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
        port = args.master_port or _free_port()
        self.launch = _Launch(args, config, model_path, device.type, dtype, world,
                              f"tcp://{args.master_addr}:{port}")
        self.page_size = args.page_size
        self._ctx = mp.get_context("spawn")
        self._errors: mp.Queue[str] = self._ctx.Queue()
        self._closing = False
        self.failure: str | None = None
        per_node = world // args.nnodes
        self.procs = [self._ctx.Process(target=_worker_main, args=(self.launch, r, r, self._errors),
                                        daemon=True) for r in range(1, per_node)]
        for p in self.procs:
            p.start()
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()
        group = _init_group(self.launch, 0)
        self.channel = _Channel(group)
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
        return self.local.prepare(scheduled)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        header, payload = _pack(batch)
        try:
            self.channel.send(header, payload)
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

    def _watch(self) -> None:
        """Notice a dead rank, log its error, stop the others. Rank 0's pending collective then
        fails and raises RankFailedError; if it hangs instead (NCCL can), exit after a grace."""
        while not self._closing:
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
                deadline = time.monotonic() + 10.0
                while not self._closing and time.monotonic() < deadline:
                    time.sleep(0.1)
                if not self._closing:
                    os._exit(1)
                return
            time.sleep(0.2)

    def _failed(self, exc: BaseException) -> "RankFailedError":
        deadline = time.monotonic() + 3.0
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return RankFailedError(f"tensor parallelism stopped: {self.failure or exc}")

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            self.channel.send([CMD_SHUTDOWN])
        except Exception:  # a dead peer: fall through to killing
            pass
        # Tear the group down together with the workers (they do the same on CMD_SHUTDOWN): NCCL's
        # teardown can wait on peers, so it must not wait for processes that already left. A
        # bounded wait, so a stuck teardown never hangs the caller's exit.
        if dist.is_initialized():
            teardown = threading.Thread(target=dist.destroy_process_group, daemon=True)
            teardown.start()
            teardown.join(timeout=15)
            if teardown.is_alive():
                log.warning("process group teardown did not finish in 15 s; continuing")
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        set_parallel_state(0, 1)


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
