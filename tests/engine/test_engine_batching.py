"""Engine machinery on a tiny random-weight Llama: batching, chunked prefill, prefix cache,
preemption, abort. Greedy outputs must not depend on how requests were scheduled."""

from __future__ import annotations

import pytest

from homelab_llm.engine.core import DuplicateRequestError, InvalidPromptError, PromptTooLongError
from homelab_llm.engine.sampling_params import SamplingParams
from tests.engine.engine_fixtures import prompts, tiny_llm

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[list[int]]:
    """Each prompt alone, one-shot prefill, no prefix cache."""
    llm = tiny_llm(tmp_path_factory.mktemp("ref"), enable_prefix_caching=False)
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts(8)]


def test_batched_equals_one_at_a_time(tmp_path, reference) -> None:
    llm = tiny_llm(tmp_path, max_num_seqs=8)
    outs = llm.generate(prompts(8), GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)


def test_chunked_prefill_equals_one_shot(tmp_path, reference) -> None:
    llm = tiny_llm(tmp_path, max_num_batched_tokens=8, enable_prefix_caching=False)
    outs = llm.generate(prompts(8), GREEDY)
    assert [o.token_ids for o in outs] == reference


def test_prefix_hit_prefills_only_the_unmatched_tokens(tmp_path) -> None:
    llm = tiny_llm(tmp_path)
    engine = llm.engine
    shared = prompts(1, seed=5, lo=30, hi=31)[0]
    first = llm.generate([shared + [7, 8]], GREEDY)[0]
    before_prompt = engine.prompt_tokens_total
    second = llm.generate([shared + [9, 10, 11]], GREEDY)[0]
    # 30 shared tokens come from the cache (one page of 4 is partial: copied, not recomputed).
    assert second.num_cached_tokens == 30
    assert engine.prompt_tokens_total - before_prompt == 3
    assert engine.kv.prefix_hit_tokens == 30
    assert engine.kv.prefix_query_tokens == 32 + 33
    cold = tiny_llm(tmp_path, enable_prefix_caching=False).generate([shared + [9, 10, 11]], GREEDY)[0]
    assert second.token_ids == cold.token_ids
    assert first.num_cached_tokens == 0


def test_prefix_caching_off_reports_no_hits(tmp_path) -> None:
    llm = tiny_llm(tmp_path, enable_prefix_caching=False)
    p = prompts(1, lo=20, hi=21)[0]
    llm.generate([p, p], GREEDY)
    assert llm.engine.kv.prefix_hit_tokens == 0


def test_tiny_kv_budget_preempts_and_still_finishes_everything(tmp_path, reference) -> None:
    # 2 layers x 2 kv heads x 16 dims x 4 B x 2 (K,V) = 512 B/token; 40 pages of 4 = 160 tokens,
    # well under the 8 prompts' ~230 tokens + 96 outputs at once.
    llm = tiny_llm(tmp_path, kv_cache_memory_bytes=512 * 160, max_num_seqs=8,
                   enable_prefix_caching=False)
    outs = llm.generate(prompts(8), GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_pages


def test_preemption_with_prefix_cache_on(tmp_path, reference) -> None:
    llm = tiny_llm(tmp_path, kv_cache_memory_bytes=512 * 160, max_num_seqs=8)
    outs = llm.generate(prompts(8), GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.scheduler.num_preemptions > 0
    # Each request's prefix lookup counts once: not again on a retried admission or a recompute.
    assert llm.engine.kv.prefix_query_tokens == sum(len(p) for p in prompts(8))


def test_abort_frees_pages_at_once(tmp_path) -> None:
    llm = tiny_llm(tmp_path, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("a", prompts(1, lo=30, hi=31)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", prompts(1, seed=2)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv.pool.num_free < engine.kv.pool.num_pages
    engine.abort_request("a")
    engine.abort_request("b")
    assert engine.kv.pool.num_free == engine.kv.pool.num_pages
    outs = engine.step()
    assert {o.request_id for o in outs} == {"a", "b"}
    assert all(o.finished and o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()
    engine.abort_request("a")  # idempotent


def test_abort_while_waiting(tmp_path) -> None:
    llm = tiny_llm(tmp_path, max_num_seqs=1)
    engine = llm.engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5))
    engine.add_request("b", [5, 6, 8], SamplingParams(max_tokens=5))
    engine.step()
    engine.abort_request("b")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.radix.evict(10**9) >= 0
    assert engine.kv.pool.num_free == engine.kv.pool.num_pages


def test_bad_requests_raise_specific_errors(tmp_path) -> None:
    llm = tiny_llm(tmp_path, max_model_len=64)
    engine = llm.engine
    with pytest.raises(PromptTooLongError, match=r"60 tokens.*max_tokens \(10\).*70.*64"):
        engine.add_request("x", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(PromptTooLongError, match="64"):
        engine.add_request("y", [5] * 64, SamplingParams(max_tokens=None))
    engine.add_request("z", [5] * 10, SamplingParams(max_tokens=None))
    with pytest.raises(DuplicateRequestError):
        engine.add_request("z", [5] * 10, SamplingParams())
    with pytest.raises(InvalidPromptError, match="token ids"):
        engine.add_request("w", [10**6], SamplingParams())
    with pytest.raises(InvalidPromptError, match="empty"):
        engine.add_request("v", [], SamplingParams())
    while engine.has_unfinished_requests():
        engine.step()


def test_max_tokens_none_runs_to_the_context_limit(tmp_path) -> None:
    llm = tiny_llm(tmp_path, max_model_len=32)
    out = llm.generate([[5] * 20], SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_admission_waits_for_pages_and_counts_its_lookup_once(tmp_path) -> None:
    # 40 pages of 4 tokens: A (100-token prompt) takes 25, B's 70-token prompt needs 18 more,
    # so B's admission fails, is retried every step, and only succeeds once A is done.
    llm = tiny_llm(tmp_path, kv_cache_memory_bytes=512 * 160, max_num_seqs=2)
    a, b = prompts(1, seed=11, lo=100, hi=101)[0], prompts(1, seed=12, lo=70, hi=71)[0]
    outs = llm.generate([a, b], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [20, 20]
    assert llm.engine.scheduler.num_preemptions == 0
    assert llm.engine.kv.prefix_query_tokens == 170
