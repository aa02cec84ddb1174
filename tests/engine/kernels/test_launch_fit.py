"""launch_fit: split counts that fill whole waves, and the residency model behind them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton

from homelab_llm.engine.kernels.launch_fit import balance_split, kernel_registers, programs_per_sm

H200 = SimpleNamespace(max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536,
                       shared_memory_per_multiprocessor=233472)


def _cost(blocks: int, steps: int, sms: int, per_sm: int, split: int, overhead: float = 2.0) -> float:
    per = triton.cdiv(steps, split)
    busy = max(1, (2 * per_sm + 2) // 3)
    return max(triton.cdiv(blocks * triton.cdiv(steps, per), sms), busy) * (per + overhead)


def test_programs_per_sm_takes_the_tightest_limit() -> None:
    # 168 registers x 128 threads: 3 programs by registers (the Nsight Compute reading on an H200)
    assert programs_per_sm(168, 16384, 4, H200) == 3
    # 64 registers x 256 threads, 17 KB shared: 4 by registers, 12 by shared memory, 8 by threads
    assert programs_per_sm(64, 17 * 1024, 8, H200) == 4
    # tiny kernels: the thread limit
    assert programs_per_sm(32, 0, 4, H200) == 16
    # a huge shared-memory user still gets one
    assert programs_per_sm(32, 400 * 1024, 4, H200) == 1


class _LazyKernel:
    """What JITFunction.warmup returns in Triton 3.x: the binary is loaded (and n_regs set) only
    when `run` is first read, by a launch or by anyone else."""

    def __init__(self, regs: int):
        self._regs = regs

    @property
    def run(self):
        self.n_regs = self._regs
        return lambda *a: None


def test_kernel_registers_loads_a_warmed_up_kernel() -> None:
    """The few-row kernel's 80 registers must reach the residency: with n_regs read before the
    binary was loaded (0) the model took shared memory alone, 10 programs an SM where 6 fit."""
    assert kernel_registers(_LazyKernel(80)) == 80
    loaded = SimpleNamespace(n_regs=96)
    assert kernel_registers(loaded) == 96
    assert kernel_registers(SimpleNamespace()) == 0  # a backend that does not say
    assert programs_per_sm(kernel_registers(_LazyKernel(80)), 20990, 4, H200) == 6
    assert programs_per_sm(0, 20990, 4, H200) == 10  # what the model took before


def test_balance_split_charges_a_partial_wave_its_share() -> None:
    """The H100 case of BENCHMARKS 44.2: the 8B's gate_up at 8 rows (448 column blocks, 32 K
    steps, 6 programs an SM of 132 SMs). Filling whole waves asked 3 splits (1,344 programs,
    39.9 us); 2 splits (896, 1.13 waves) ran 38.1 us, and the balance model takes 2."""
    assert balance_split(448, 32, 132, 6, min_steps=2) == 2
    # 27B down at 8 rows: 80 blocks, 136 steps; enough splits to give every SM its busy share
    split = balance_split(80, 136, 132, 6, min_steps=2)
    assert 80 * split >= 4 * 132 and split <= 12
    # many waves of blocks already keep every SM busy: no split
    assert balance_split(5000, 40, 132, 6) == 1


def test_balance_split_is_the_model_minimum_and_keeps_min_steps() -> None:
    for blocks, steps, sms, per_sm, min_steps in [(272, 40, 132, 4, 2), (1, 64, 132, 6, 1), (500, 10, 132, 2, 2),
                                                  (4, 7, 66, 3, 1), (64, 1, 100, 6, 1), (80, 136, 132, 2, 2)]:
        split = balance_split(blocks, steps, sms, per_sm, min_steps)
        assert 1 <= split <= max(1, steps // min_steps)
        assert triton.cdiv(steps, triton.cdiv(steps, split)) == split  # whole steps, none empty
        cands = [s for s in range(1, max(1, steps // min_steps) + 1)
                 if triton.cdiv(steps, triton.cdiv(steps, s)) == s]
        best = min(_cost(blocks, steps, sms, per_sm, s) for s in cands)
        assert _cost(blocks, steps, sms, per_sm, split) <= 1.05 * best
        assert all(_cost(blocks, steps, sms, per_sm, s) > 1.05 * best for s in cands if s < split)  # the fewest


def test_launch_fitting_stages_steps_down_and_remembers() -> None:
    """A launch that does not fit the shared memory (Triton's OutOfResources, raised before
    anything is enqueued) is retried with one stage fewer; the count that fit is reused for the
    same key; one stage that does not fit is the caller's error."""
    from triton.runtime.errors import OutOfResources

    from homelab_llm.engine.kernels.launch_fit import launch_fitting_stages

    tried: list[int] = []

    def launch(stages: int) -> None:
        tried.append(stages)
        if stages > 2:
            raise OutOfResources(stages * 100_000, 232_448, "shared memory")

    launch_fitting_stages(launch, ("fp32-kv", 256), 5)
    assert tried == [5, 4, 3, 2]
    launch_fitting_stages(launch, ("fp32-kv", 256), 5)
    assert tried[4:] == [2]

    def never(stages: int) -> None:
        raise OutOfResources(1, 0, "shared memory")

    with pytest.raises(OutOfResources):
        launch_fitting_stages(never, ("too-big",), 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's loaded binaries need a GPU")
def test_kernel_registers_of_a_real_warmed_up_kernel() -> None:
    """On the GPU: a kernel straight from JITFunction.warmup (never launched) reports its
    registers, and the residency of the few-row W4A16 kernel counts them."""
    import triton.language as tl

    from homelab_llm.engine.kernels.launch_fit import resident_per_sm

    @triton.jit
    def _scale(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)

    x = torch.zeros(1024, device="cuda")
    compiled = _scale.warmup(x, 1024, BLOCK=256, grid=(1,))
    regs = kernel_registers(compiled)
    assert 0 < regs <= 255
    props = torch.cuda.get_device_properties(x.device)
    per_sm = resident_per_sm(_scale, ("test", 256), x.device, (x, 1024), dict(BLOCK=256, num_warps=4))
    assert per_sm == programs_per_sm(regs, compiled.metadata.shared, 4, props)
