"""Tensor parallelism: what every rank needs to start: the size check (sharding.py's rule as a flag
error), the launch record a spawned rank receives, its device, its process group (plus, on GPUs,
the peer-buffer all-reduce). A worker's tie to the process that started it is
parent_watch.die_with_parent."""

from __future__ import annotations

import atexit
import datetime
import shutil
import socket
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from homelab_llm.engine.args import EngineArgs, EngineArgsError
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.parallel.state import set_parallel_state
from homelab_llm.engine.sharding import ShardingError, check_tp_size

if TYPE_CHECKING:
    from homelab_llm.engine.parallel.comm import PeerAllReduce


def check_tp_flag(config: ModelConfig, tp_size: int) -> None:
    """sharding.check_tp_size as a flag error (every split the model needs, valid sizes named)."""
    try:
        check_tp_size(config, tp_size)
    except ShardingError as exc:
        raise EngineArgsError(str(exc)) from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_url(args: EngineArgs) -> str:
    """Where the ranks meet. One node: a file store in a private temporary folder, so nothing
    listens on a socket (torch's TCP store binds every interface, unauthenticated, for the
    server's lifetime). Several nodes: TCP on --master-addr/--master-port, as torchrun does."""
    if args.nnodes == 1:
        folder = tempfile.mkdtemp(prefix="homelab-llm-rdzv-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        return f"file://{folder}/store"
    return f"tcp://{args.master_addr}:{args.master_port or free_port()}"


def device_for(device_type: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")


@dataclass
class LaunchSpec:
    args: EngineArgs
    config: ModelConfig
    model_path: str
    device_type: str
    dtype: torch.dtype
    world_size: int
    init_method: str
    plan_ring: str | None = None  # the shared-memory ring's path when the plan crosses through it


def init_group(launch: LaunchSpec, rank: int) -> tuple[dist.ProcessGroup, PeerAllReduce | None]:
    """The process group, and on GPUs this rank's peer-buffer all-reduce (kept for shutdown)."""
    backend = "nccl" if launch.device_type == "cuda" else "gloo"
    if launch.device_type == "cuda":
        torch.cuda.set_device(device_for("cuda", rank % max(1, torch.cuda.device_count())))
    dist.init_process_group(backend, init_method=launch.init_method, rank=rank,
                            world_size=launch.world_size, timeout=datetime.timedelta(minutes=10))
    set_parallel_state(rank, launch.world_size)
    # The plan always crosses on the CPU, so ranks get host-side lengths without a device sync.
    group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    comm = None
    if backend == "nccl":  # small all-reduces over peer-mapped buffers where P2P works
        from homelab_llm.engine.parallel.comm import setup_all_reduce

        comm = setup_all_reduce(group)
    return group, comm
