"""benchmarks/soak_gpu.py's loop on the CPU: a random mix with shared prefixes, n > 1, aborts at
random moments and a small KV cache (preemption), on a step budget (no wall clock). It must end
clean, and it must notice a leak or a failed request."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.engine.engine_fixtures import tiny_llm

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak_gpu.py"


@pytest.fixture(scope="module")
def soak_module():
    spec = importlib.util.spec_from_file_location("soak_gpu", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak_gpu"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def small_engine(tmp_path: Path):
    # 512 B per token: 120 pages of 4 = 480 tokens, under max_num_seqs x max_model_len.
    return tiny_llm(tmp_path, kv_cache_memory_bytes=512 * 480, max_num_seqs=6, max_model_len=160,
                    max_num_batched_tokens=64).engine


def test_soak_loop_ends_clean(tmp_path: Path, soak_module) -> None:
    engine = small_engine(tmp_path)
    result = soak_module.soak(engine, "tiny", seconds=None, max_steps=60, seed=1, abort_rate=0.1)
    assert result.failures == [], result.failures
    assert result.requests >= 10 and result.finish["abort"] >= 1
    assert sum(result.finish.values()) == result.requests  # every request ended with a reason
    assert result.preemptions > 0 and result.prefix_hit_tokens > 0
    assert "OK" in result.line()


def test_soak_reports_a_held_page_and_a_failed_request(tmp_path: Path, soak_module) -> None:
    engine = small_engine(tmp_path)
    engine.kv.pool.alloc(1)  # a page nobody returns

    def poison(batch) -> None:
        if batch.num_tokens > 40:
            raise ValueError("boom")

    engine.runner.fault_hook = poison
    result = soak_module.soak(engine, "tiny", seconds=None, max_steps=15, seed=2)
    assert any("KV page(s) still held" in f for f in result.failures)
    assert any("ended error" in f for f in result.failures)
    assert "FAIL" in result.line()
