"""Tensor parallelism: ranks 1..N-1. Each one runs the plans rank 0 sends until it says shut down;
a rank that raises reports its error to rank 0 and exits non-zero, and every worker dies with the
process that started it (no orphans). Nodes other than node 0 (--node-rank) start theirs here.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import traceback

import torch
import torch.distributed as dist

from homelab_llm.engine.args import EngineArgs, EngineArgsError
from homelab_llm.engine.device import resolve_target
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.parallel.channel import open_channel, receive_patch
from homelab_llm.engine.parallel.launch import LaunchSpec, check_tp_flag, device_for, init_group
from homelab_llm.engine.parallel.ring import ShmRing
from homelab_llm.engine.parallel.shutdown import SHUTDOWN_WAIT_S, default_store, leave, wait_done
from homelab_llm.engine.runner import ModelRunner
from homelab_llm.engine.step_plan import (CMD_ALLOCATE, CMD_GRAPHS, CMD_MEMORY, CMD_PAGES,
                                          CMD_SHUTDOWN, CMD_STEP)
from homelab_llm.parent_watch import die_with_parent


def worker_loop(launch: LaunchSpec, rank: int, local_rank: int) -> None:
    group, comm = init_group(launch, rank)
    ring = None if launch.plan_ring is None else ShmRing.attach(launch.plan_ring, local_rank - 1)
    channel = open_channel(group, ring)
    dist.barrier(group=group)  # every reader mapped the ring: rank 0 may unlink its name
    runner = ModelRunner(launch.args, launch.config, launch.model_path,
                         device_for(launch.device_type, local_rank), launch.dtype,
                         tp_rank=rank, tp_size=launch.world_size)
    while True:
        header, payload = channel.recv()
        if header.cmd == CMD_STEP:
            plan_len = header.payload_len - header.patch_len
            batch = runner.batch_from_plan(header, payload[:plan_len])
            if header.patch_len:  # async scheduling: the previous step's tokens, from rank 0
                receive_patch(payload[plan_len:].tolist(), batch, runner)
            runner.forward(batch)
        elif header.cmd == CMD_PAGES:
            channel.min_all(runner.pages_for_budget(runner.kv_budget()))
        elif header.cmd == CMD_ALLOCATE:
            runner.allocate_pages(header.arg)
        elif header.cmd == CMD_MEMORY:
            runner.refresh_memory()
            channel.gather_memory(runner.memory)
        elif header.cmd == CMD_GRAPHS:
            runner.capture_graphs(header.arg)
        elif header.cmd == CMD_SHUTDOWN:
            break
    leave(channel, runner, comm, launch.device_type, SHUTDOWN_WAIT_S)
    # No teardown here: this process's exit releases its communicators. It only has to outlive
    # rank 0's, so that no live communicator on rank 0 sees this rank vanish.
    wait_done(default_store(), SHUTDOWN_WAIT_S)
    channel.close()


def worker_main(launch: LaunchSpec, rank: int, local_rank: int, errors: "mp.Queue[str]") -> None:
    die_with_parent()
    logging.basicConfig(level=logging.INFO)
    try:
        worker_loop(launch, rank, local_rank)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip interpreter teardown: graphs and communicators go with the process
    except BaseException as exc:  # report every failure to rank 0, then exit non-zero
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        errors.close()
        errors.join_thread()  # the queue's feeder thread must flush before we exit
        sys.stderr.flush()
        os._exit(1)


def run_worker_node(args: EngineArgs, config: ModelConfig, model_path: str,
                    device_type: str, dtype: torch.dtype) -> int:
    """A node other than node 0: run this node's ranks until rank 0 says shut down.

    Same flags as node 0 plus --node-rank; rendezvous at --master-addr:--master-port (env://
    style, torchrun-compatible numbering: global rank = node_rank * ranks_per_node + local)."""
    world = args.tensor_parallel_size
    if not args.master_port:
        raise EngineArgsError("--node-rank > 0 needs --master-port (and --master-addr) of node 0")
    per_node = world // args.nnodes
    launch = LaunchSpec(args, config, model_path, device_type, dtype, world,
                     f"tcp://{args.master_addr}:{args.master_port}")
    ctx = mp.get_context("spawn")
    errors: mp.Queue[str] = ctx.Queue()
    first = args.node_rank * per_node
    procs = [ctx.Process(target=worker_main, args=(launch, first + i, i, errors), daemon=True)
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
    args.validate()
    target = resolve_target(args)
    check_tp_flag(target.config, args.tensor_parallel_size)
    return run_worker_node(args, target.config, target.path, target.device.type, target.dtype)
