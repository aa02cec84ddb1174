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
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.runner import ModelRunner
from homelab_llm.engine.step_channel import ShmRing
from homelab_llm.engine.tp_channel import (CMD_ALLOCATE, CMD_GRAPHS, CMD_MEMORY, CMD_PAGES,
                                           CMD_SHUTDOWN, CMD_STEP, _Channel, _receive_patch,
                                           _ShmChannel, _unpack)
from homelab_llm.engine.tp_launch import (_device_for, _die_with_parent, _init_group, _Launch,
                                          check_tp_size)
from homelab_llm.engine.tp_shutdown import (SHUTDOWN_WAIT_S, _default_store, _leave,
                                            _wait_done)


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
