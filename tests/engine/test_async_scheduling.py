"""Async scheduling (the next step launched before this step's tokens are read) gives exactly the
tokens of the synchronous loop, finishes every request, and leaks no KV page.

The loop is forced on here on the CPU (where it brings no speed) so that CI checks its bookkeeping:
placeholders, input patching, sequences that end on a token the host has not read yet, aborts
with a token in flight, the fallback steps that need tokens on the host (logprobs, penalties,
min_tokens), and grammar-constrained requests, which run ahead too."""

from __future__ import annotations

import json
import re
from pathlib import Path

from homelab_llm.engine.pending import PLACEHOLDER
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.structured.grammar import GrammarSpec, to_grammar
from tests.engine.engine_fixtures import prompts, tiny_llm, write_config


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.9, top_k=40, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0.7, top_p=0.8, seed=9, stop_token_ids=[7, 11, 13, 17]),
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True),  # host-side step
        SamplingParams(max_tokens=8, temperature=0.8, seed=3, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, min_tokens=4, ignore_eos=False),
        SamplingParams(max_tokens=12, temperature=1.0, seed=1, ignore_eos=False),
    ]


def _run(llm, ps, params):
    return [(o.token_ids, o.finish_reason) for o in llm.generate(ps, params)]


def test_async_matches_sync_and_frees_every_page(tmp_path: Path) -> None:
    ps = prompts(8, seed=4)
    params = _params()
    sync = tiny_llm(tmp_path, max_num_seqs=4)
    want = _run(sync, ps, params)
    llm = tiny_llm(tmp_path, max_num_seqs=4)
    engine = llm.engine
    engine._async = True
    got = _run(llm, ps, params)
    assert got == want
    assert engine._pending is None and not engine.has_unfinished_requests()
    pool = engine.kv.pool
    # Every page is free or held only by the prefix cache; evicting the cache frees them all.
    engine.kv.radix.evict(pool.num_pages)
    assert pool.num_free == pool.num_pages, (pool.num_free, pool.num_pages)


def test_abort_with_a_token_in_flight(tmp_path: Path) -> None:
    llm = tiny_llm(tmp_path, max_num_seqs=4)
    engine = llm.engine
    engine._async = True
    for i, p in enumerate(prompts(3, seed=2)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    seen: dict[str, list[int]] = {}
    for _ in range(4):
        for out in engine.step():
            seen.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine._pending is not None  # a step's tokens are on the way
    victim = engine._pending.seqs[0]
    assert victim.token_ids[-1] == PLACEHOLDER
    engine.abort_request(victim.request_id)
    assert PLACEHOLDER not in victim.token_ids
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert PLACEHOLDER not in out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished[victim.request_id] == "abort"
    assert all(len(seen[r]) == 20 for r in finished if r != victim.request_id)
    engine.kv.radix.evict(engine.kv.pool.num_pages)
    assert engine.kv.pool.num_free == engine.kv.pool.num_pages


def test_preemption_under_a_tiny_kv_budget(tmp_path: Path) -> None:
    """Pages run short while tokens are in flight: the engine falls back to reading them first,
    preempts as the synchronous loop does, and every request still completes identically."""
    ps = prompts(6, seed=8, lo=20, hi=40)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = _run(tiny_llm(tmp_path, kv_cache_memory_bytes=40 * 1024, max_num_seqs=6), ps, params)
    llm = tiny_llm(tmp_path, kv_cache_memory_bytes=40 * 1024, max_num_seqs=6)
    llm.engine._async = True
    assert _run(llm, ps, params) == want


def test_tensor_parallel_ranks_get_the_in_flight_tokens(tmp_path: Path) -> None:
    """TP=2 with async scheduling: rank 0 sends the previous step's tokens to the other rank
    (a broadcast after the plan), which patches its own inputs; tokens equal the synchronous run."""
    ps = prompts(5, seed=6)
    params = _params()[:5]
    params[4] = SamplingParams(max_tokens=7, temperature=0.5, seed=2, ignore_eos=True)
    sync = tiny_llm(tmp_path, max_num_seqs=4, tensor_parallel_size=2)
    try:
        want = _run(sync, ps, params)
    finally:
        sync.shutdown()
    llm = tiny_llm(tmp_path, max_num_seqs=4, tensor_parallel_size=2)
    try:
        llm.engine._async = True
        assert _run(llm, ps, params) == want
        assert llm.engine._pending is None
    finally:
        llm.shutdown()


def test_constrained_requests_run_ahead_with_the_same_tokens(tmp_path: Path) -> None:
    """A grammar keeps async scheduling on: the next forward is launched before the token is read,
    the matcher consumes it, then masks the next sample; the tokens equal the synchronous loop's."""
    regex = to_grammar(GrammarSpec("regex", "[a-f]{3}(-[0-9]{2}){4}"))
    schema = to_grammar(GrammarSpec("json_schema", json.dumps({
        "type": "object", "required": ["k"], "properties": {"k": {"enum": ["xy", "zw"]}}})))
    params = [SamplingParams(max_tokens=20, temperature=0.0, grammar=regex),
              SamplingParams(max_tokens=20, temperature=0.8, seed=2, grammar=schema),
              SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)]
    ps = prompts(3, seed=7)
    outs = []
    for run_ahead in (False, True):
        llm = tiny_llm(tmp_path, max_num_seqs=4, tokenizer=str(write_config(tmp_path)))  # bytes
        engine = llm.engine
        engine._async = run_ahead
        ahead_with_grammar = 0
        for i, (p, sp) in enumerate(zip(ps, params)):
            engine.add_request(f"r{i}", p, sp)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)
            pending = engine._pending
            ahead_with_grammar += pending is not None and any(s.grammar is not None for s in pending.seqs)
        outs.append(done)
        assert (ahead_with_grammar > 0) == run_ahead
    assert outs[0] == outs[1]
    text = bytes(t for t in outs[0]["r0"] if t < 256).decode()  # the end-of-sequence token dropped
    assert re.fullmatch("[a-f]{3}(-[0-9]{2}){4}", text), text
