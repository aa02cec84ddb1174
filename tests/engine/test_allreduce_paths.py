"""Which all-reduce path a message takes (engine/parallel/comm.py) and how parallel.all_reduce dispatches.
The kernel itself is tested in tests/engine/kernels/test_allreduce.py; the real two-GPU run is in
benchmarks/tp_gpu.py (section allreduce)."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.parallel import state as parallel
from homelab_llm.engine.parallel.comm import PROBE_SIZES, PathTable, choose_paths, read_mode

pytestmark = pytest.mark.timeout(60)


def test_no_p2p_or_failed_check_means_nccl_for_every_size():
    for mode in ("auto", "custom"):
        table = choose_paths(mode, usable=False, sizes=PROBE_SIZES)
        assert not any(table.custom_for(s) for s in (1, 8 << 10, 2 << 20))


def test_auto_takes_the_faster_path_per_size():
    sizes = (8 << 10, 32 << 10, 1 << 20)
    table = choose_paths("auto", True, sizes, custom_us=[5.0, 6.0, 40.0], nccl_us=[20.0, 21.0, 30.0])
    assert table.custom_for(1) and table.custom_for(8 << 10)
    assert table.custom_for((8 << 10) + 1)  # falls in the 32 KB row
    assert not table.custom_for(1 << 20)  # NCCL measured faster
    assert not table.custom_for((1 << 20) + 2)  # over the last probed size: NCCL


def test_override_modes():
    sizes = (8 << 10, 2 << 20)
    forced = choose_paths("custom", True, sizes)
    assert forced.custom_for(2 << 20) and not forced.custom_for((2 << 20) + 1)
    for mode in ("nccl", "none"):
        assert choose_paths(mode, True, sizes, [1.0, 1.0], [9.0, 9.0]) == PathTable()


def test_read_mode(monkeypatch):
    monkeypatch.delenv("HOMELAB_ALLREDUCE", raising=False)
    assert read_mode() == "auto"
    monkeypatch.setenv("HOMELAB_ALLREDUCE", "NCCL")
    assert read_mode() == "nccl"
    monkeypatch.setenv("HOMELAB_ALLREDUCE", "fast")
    with pytest.raises(ValueError, match="HOMELAB_ALLREDUCE"):
        read_mode()


class _FakePeer:
    def __init__(self, limit: int) -> None:
        self.limit, self.calls, self.closed = limit, 0, False

    def handles(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.limit

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.mul_(2)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def two_ranks(monkeypatch):
    nccl_calls = []
    monkeypatch.setattr(parallel.dist, "all_reduce", lambda x: nccl_calls.append(x.numel()))
    parallel.set_parallel_state(0, 2)
    yield nccl_calls
    parallel.set_parallel_state(0, 1)


def test_dispatch_small_to_peer_large_to_nccl(two_ranks):
    peer = _FakePeer(limit=1024)
    parallel.set_all_reduce(peer)
    small = torch.ones(256)  # 1 KB
    assert torch.equal(parallel.all_reduce(small), torch.full((256,), 2.0))
    parallel.all_reduce(torch.ones(257))
    assert peer.calls == 1 and two_ranks == [257]
    parallel.set_parallel_state(0, 1)  # a new group releases the old buffers
    assert peer.closed


def test_skip_mode_leaves_tensors_alone(two_ranks):
    parallel.set_all_reduce(None, skip=True)
    x = torch.ones(8)
    assert parallel.all_reduce(x) is x and two_ranks == []
    assert torch.equal(x, torch.ones(8))


def test_one_rank_is_the_identity():
    parallel.set_parallel_state(0, 1)
    x = torch.ones(4)
    assert parallel.all_reduce(x) is x
