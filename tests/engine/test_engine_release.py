"""A shut-down engine gives its memory back: once the last reference to it is dropped, its model,
runner(s) and KV pool are gone by reference counting alone (no reference cycle, thread, registry or
hook keeps them), so a second engine in the same process finds the device memory free."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from homelab_llm.engine.sampling_params import SamplingParams
from tests.engine.engine_fixtures import tiny_llm

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _holders(obj: object) -> list[str]:
    """What still refers to obj (for the failure message)."""
    return [type(r).__name__ for r in gc.get_referrers(obj)][:10]


def _build_and_drop(tmp: Path, tp: int) -> dict[str, weakref.ref]:
    llm = tiny_llm(tmp, tensor_parallel_size=tp, max_num_seqs=4)
    llm.generate([[5, 6, 7, 8], [9, 10]], GREEDY)
    engine = llm.engine
    runner = engine.runner
    local = getattr(runner, "local", runner)  # rank 0's ModelRunner under tensor parallelism
    refs = {"engine": weakref.ref(engine), "runner": weakref.ref(runner),
            "model_runner": weakref.ref(local), "model": weakref.ref(local.model),
            "pool": weakref.ref(local.pool), "kv": weakref.ref(engine.kv)}
    llm.shutdown()
    assert local.model is None and local.pool is None  # let go at shutdown already
    del llm, engine, runner, local
    return refs


@pytest.mark.parametrize("tp", [1, 2])
def test_a_shut_down_engine_is_freed_without_the_cycle_collector(tmp_path: Path, tp: int) -> None:
    gc.collect()
    gc.disable()  # an automatic collection here would hide a cycle
    try:
        refs = _build_and_drop(tmp_path, tp)
        alive = {name: r() for name, r in refs.items() if r() is not None}
        assert not alive, {name: _holders(obj) for name, obj in alive.items()}
    finally:
        gc.enable()
    gc.collect()
    assert all(r() is None for r in refs.values())


def test_the_model_goes_at_shutdown_even_while_the_engine_is_still_held(tmp_path: Path) -> None:
    llm = tiny_llm(tmp_path)
    llm.generate([[5, 6, 7]], GREEDY)
    model = weakref.ref(llm.engine.runner.model)
    llm.shutdown()
    assert model() is None  # the caller still holds llm: the weights are gone all the same
    llm.shutdown()  # twice is harmless
