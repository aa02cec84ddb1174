"""Tensor parallelism: which sizes split a model, and what every rank needs to start: the launch
record a spawned rank receives, its device, its process group (plus, on GPUs, the peer-buffer
all-reduce), and a worker's tie to the process that started it."""

from __future__ import annotations

import ctypes
import datetime
import signal
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from homelab_llm.engine.args import EngineArgs, EngineArgsError
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.parallel import set_parallel_state

if TYPE_CHECKING:
    from homelab_llm.engine.comm import PeerAllReduce


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """Sizes that work: any N up to num_kv_heads (uneven splits are fine); above that, N must
    divide num_attention_heads and be a multiple of num_kv_heads (KV heads are replicated)."""
    sizes = list(range(1, config.num_key_value_heads + 1))
    for n in range(config.num_key_value_heads + 1, config.num_attention_heads + 1):
        if config.num_attention_heads % n == 0 and n % config.num_key_value_heads == 0:
            sizes.append(n)
    if config.is_hybrid:  # Gated DeltaNet key and value heads (and their conv channels) split evenly
        sizes = [n for n in sizes
                 if config.linear_num_key_heads % n == 0 and config.linear_num_value_heads % n == 0]
    return sizes


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    valid = valid_tp_sizes(config)
    if tp_size not in valid:
        raise EngineArgsError(
            f"--tensor-parallel-size {tp_size} cannot split {config.num_attention_heads} query / "
            f"{config.num_key_value_heads} KV heads"
            + (f" and {config.linear_num_key_heads} / {config.linear_num_value_heads} linear-"
               "attention key / value heads" if config.is_hybrid else "")
            + f"; valid sizes: {', '.join(map(str, valid))}")


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
