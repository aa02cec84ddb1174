"""Where tensor-parallel ranks meet: one node never opens a TCP store (issue 12: torch's store
binds every interface, unauthenticated); several nodes use --master-addr/--master-port."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from homelab_llm.engine.args import EngineArgs
from homelab_llm.engine.parallel.launch import rendezvous_url


def test_one_node_meets_through_a_private_file_store() -> None:
    url = rendezvous_url(EngineArgs(model="x", tensor_parallel_size=2))
    assert url.startswith("file://")
    folder = Path(url.removeprefix("file://")).parent
    assert folder.is_dir() and folder.name.startswith("homelab-llm-rdzv-")
    assert not any(folder.iterdir())  # the store file is made by the ranks, not before
    # Usable as is: a one-rank gloo group forms through it and leaves no socket behind.
    dist.init_process_group("gloo", init_method=url, rank=0, world_size=1)
    try:
        assert dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


def test_several_nodes_meet_over_tcp_on_the_master_address() -> None:
    args = EngineArgs(model="x", tensor_parallel_size=4, nnodes=2, master_addr="10.0.0.5",
                      master_port=29555)
    assert rendezvous_url(args) == "tcp://10.0.0.5:29555"
