"""launch_fit: split counts that fill whole waves, and the residency model behind them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import triton

from homelab_llm.engine.kernels.launch_fit import fit_split, programs_per_sm

H200 = SimpleNamespace(max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536,
                       shared_memory_per_multiprocessor=233472)


def _cost(blocks: int, steps: int, resident: int, split: int, overhead: float = 1.0) -> float:
    per = triton.cdiv(steps, split)
    return triton.cdiv(blocks * triton.cdiv(steps, per), resident) * (per + overhead)


def test_programs_per_sm_takes_the_tightest_limit() -> None:
    # 168 registers x 128 threads: 3 programs by registers (the Nsight Compute reading on an H200)
    assert programs_per_sm(168, 16384, 4, H200) == 3
    # 64 registers x 256 threads, 17 KB shared: 4 by registers, 12 by shared memory, 8 by threads
    assert programs_per_sm(64, 17 * 1024, 8, H200) == 4
    # tiny kernels: the thread limit
    assert programs_per_sm(32, 0, 4, H200) == 16
    # a huge shared-memory user still gets one
    assert programs_per_sm(32, 400 * 1024, 4, H200) == 1


def test_fit_split_fills_one_wave_instead_of_a_partial_second() -> None:
    # a 27B gate_up at 1 row: 34 column blocks, 80 K steps, 396 resident programs
    split = fit_split(34, 80, 396)
    assert 34 * split <= 396 and split >= 8
    # power-of-two rule's 16 splits (544 programs, 1.37 waves) costs more by the same model
    assert _cost(34, 80, 396, split) < _cost(34, 80, 396, 16)


def test_fit_split_is_the_model_minimum_and_keeps_min_steps() -> None:
    for blocks, steps, resident, min_steps in [(272, 40, 528, 2), (1, 64, 132, 1), (500, 10, 132, 2),
                                                (4, 7, 264, 1), (64, 1, 100, 1)]:
        split = fit_split(blocks, steps, resident, min_steps)
        assert 1 <= split <= max(1, steps // min_steps)
        assert triton.cdiv(steps, triton.cdiv(steps, split)) == split  # whole steps, none empty
        best = min(_cost(blocks, steps, resident, s) for s in range(1, max(1, steps // min_steps) + 1))
        assert _cost(blocks, steps, resident, split) <= 1.05 * best
        assert all(_cost(blocks, steps, resident, s) > 1.05 * best for s in range(1, split)
                   if triton.cdiv(steps, triton.cdiv(steps, s)) == s)  # the fewest such splits
    # already many waves of blocks: no split
    assert fit_split(5000, 40, 528) == 1


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
