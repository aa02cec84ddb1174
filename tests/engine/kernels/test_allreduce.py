"""The one-shot all-reduce kernel in one process: rank RANK's kernel runs against N-1 fake peers
whose buffers hold their slices already and whose "ready" flags are pre-set, so the barrier passes
at once. Checked: the sum (fp32 exact; bf16 within one bf16 ulp of the fp32 sum, since the CPU
interpreter rounds fp32 -> bf16 by truncation where GPUs round to nearest), bit-identical results
whichever rank computes, the flags it writes into every peer, its epoch counters, and the other
buffer half on the next call."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels.allreduce import all_reduce_ref, one_shot_all_reduce, signal_words

PROGRAMS = 4
BLOCK = 256
READY = 1 << 40  # a peer flag far ahead of any epoch: "every peer is there"


class FakeGroup:
    def __init__(self, world: int, half: int, dtype: torch.dtype, device: torch.device) -> None:
        self.world, self.half = world, half
        self.data = [torch.zeros(2 * half, dtype=dtype, device=device) for _ in range(world)]
        self.signal = [torch.zeros(signal_words(PROGRAMS, world), dtype=torch.int64, device=device)
                       for _ in range(world)]
        for s in self.signal:
            s[: PROGRAMS * world] = READY
        self.data_ptrs = torch.tensor([d.data_ptr() for d in self.data], dtype=torch.int64, device=device)
        self.signal_ptrs = torch.tensor([s.data_ptr() for s in self.signal], dtype=torch.int64,
                                        device=device)

    def post(self, parts: list[torch.Tensor], rank: int, epoch: int) -> None:
        """What the peers' own kernels would have copied in for this epoch."""
        start = (epoch % 2) * self.half
        for r, p in enumerate(parts):
            if r != rank:
                self.data[r][start:start + p.numel()] = p

    def flags(self, rank: int) -> torch.Tensor:
        return self.signal[rank][: PROGRAMS * self.world].view(PROGRAMS, self.world)

    def counters(self, rank: int) -> torch.Tensor:
        return self.signal[rank][PROGRAMS * self.world:]


def _check_sum(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
    exact = torch.zeros_like(parts[0], dtype=torch.float32)
    for p in parts:
        exact += p.float()
    if out.dtype == torch.float32:
        assert torch.equal(out, all_reduce_ref(parts))
    else:  # one bf16 ulp: 2^(exponent - 7)
        ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
        assert bool(((out.float() - exact).abs() <= ulp).all())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("n", [1, 1000, 3001])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_shot_sum_matches_reference(world, n, dtype, device):
    gen = torch.Generator().manual_seed(world * 100 + n)
    half = 4096
    parts = [torch.randn(n, generator=gen).to(dtype).to(device) for _ in range(world)]
    outs = []
    for rank in range(world):
        g = FakeGroup(world, half, dtype, device)
        g.post(parts, rank, epoch=1)
        x = parts[rank].clone()
        out = one_shot_all_reduce(x, x, g.data_ptrs, g.signal_ptrs, half, rank, world, PROGRAMS,
                                  block=BLOCK, num_warps=4)
        _check_sum(out.cpu(), [p.cpu() for p in parts])
        outs.append(out.cpu())
        # every program told every peer "epoch 1" in the peer's slot for this rank
        for r in range(world):
            if r != rank:
                assert torch.all(g.flags(r)[:, rank] == 1)
        assert torch.all(g.counters(rank) == 1)
        assert torch.equal(g.data[rank][half:half + n].cpu(), parts[rank].cpu())  # copied in
    for out in outs[1:]:
        assert torch.equal(out, outs[0])  # every rank gets the same bits


@pytest.mark.timeout(300)
def test_second_call_uses_the_other_half_and_a_separate_output(device):
    world, rank, n, half = 2, 1, 777, 1024
    gen = torch.Generator().manual_seed(7)
    g = FakeGroup(world, half, torch.float32, device)
    for epoch in (1, 2):
        parts = [torch.randn(n, generator=gen).to(device) for _ in range(world)]
        g.post(parts, rank, epoch)
        x = parts[rank].clone()
        out = torch.empty_like(x)
        one_shot_all_reduce(x, out, g.data_ptrs, g.signal_ptrs, half, rank, world, PROGRAMS,
                            block=BLOCK, num_warps=4)
        assert torch.equal(out.cpu(), all_reduce_ref([p.cpu() for p in parts]))
        assert torch.equal(x, parts[rank])  # input untouched
        assert torch.all(g.counters(rank) == epoch)
        assert torch.all(g.flags(0)[:, rank] == epoch)
    start = (2 % 2) * half
    assert torch.equal(g.data[rank][start:start + n], parts[rank])  # epoch 2 wrote the even half


def test_rejects_a_message_over_the_buffer(device):
    g = FakeGroup(2, 64, torch.float32, device)
    x = torch.zeros(65, device=device)
    with pytest.raises(ValueError, match="exceeds"):
        one_shot_all_reduce(x, x, g.data_ptrs, g.signal_ptrs, 64, 0, 2, PROGRAMS)
