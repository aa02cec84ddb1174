"""Per-layer-type page groups on mixed full/sliding models (Gemma 3 text, gpt-oss; window 8,
pages of 4) through the whole engine: chunked prompts several windows long and decode far past
the window give transformers' logits and greedy tokens; the sliding group holds about a window
of pages per sequence; the prefix cache resumes only where the window is held; preemption,
abort and finish leak no page in either group.

Tolerance: fp32 on both sides, 1e-3 absolute on logits (the sliding parity tests observe ~1e-5);
reading a page given back, or the wrong group's table, moves them by O(1).
"""

from __future__ import annotations

import json

import pytest
import torch

from hybrid_reference import greedy, our_llm
from model_reference import hf_logits
from sliding_reference import WINDOW, make_sliding_model

ATOL = 1e-3
PAGE = 4
PROMPT = [(7 * i + 3) % 190 + 3 for i in range(45)]  # > 5 windows
N_OUT = 30
# A window of 8 starting anywhere in a page spans 3 pages of 4, plus the page of the next token.
WINDOW_PAGES = -(-WINDOW // PAGE) + 1


@pytest.fixture(scope="module", params=["gemma3", "gpt_oss"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    # the byte-level tokenizer the engine falls back to needs a vocab of 258 or more
    return folder, make_sliding_model(request.param, folder, vocab_size=300)


def engine_llm(folder, **kw):
    args = dict(max_num_batched_tokens=16, max_num_seqs=4, page_size=PAGE)
    args.update(kw)
    return our_llm(folder, **args)


def record_logits(llm) -> list[torch.Tensor]:
    """Every step's sampled-row logits, in step order."""
    rows: list[torch.Tensor] = []
    forward = llm.engine.runner.forward

    def wrapped(batch):
        out = forward(batch)
        rows.append(out.clone())
        return out

    llm.engine.runner.forward = wrapped
    return rows


def run_one(llm, prompt: list[int], n: int) -> tuple[list[int], list[tuple[int, int, int]], int]:
    """Greedy tokens; per step (tokens computed, full-group pages, sliding pages held) of the
    running sequence; prompt tokens served by the prefix cache."""
    engine = llm.engine
    engine.add_request("r", prompt, greedy(n))
    seq = engine._seqs["r"]
    tokens, held = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
        if seq in engine.scheduler.running:
            held.append((seq.num_computed_tokens, len(seq.page_table),
                         len(seq.sliding_table) - seq.sliding_released))
    return tokens, held, seq.num_cached_tokens


def check_against_hf(hf, prompt: list[int], tokens: list[int], logits: torch.Tensor) -> None:
    """Logits of every sampled position within ATOL of transformers', and every greedy token
    transformers' argmax after the same prefix (so its greedy run gives the same tokens)."""
    ref = hf_logits(hf, prompt + tokens[:-1])[-len(tokens):]
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    assert tokens == ref.argmax(-1).tolist()


def assert_no_pages_held(engine) -> None:
    """Both groups' pools are whole again once the prefix cache lets go of everything."""
    kv = engine.kv
    if kv.radix is not None:
        kv.radix.evict(kv.pool.num_pages)
    assert kv.pool.num_free == kv.pool.num_pages
    assert kv.sliding.pool.num_free == kv.sliding.pool.num_pages


def test_parity_and_a_window_of_sliding_pages(model) -> None:
    check_parity_and_window(*model)


def test_qwen2_window_layers_get_a_page_group(tmp_path) -> None:
    """Qwen2 with use_sliding_window: layer 0 full (max_window_layers), the rest sliding."""
    check_parity_and_window(tmp_path, make_sliding_model("qwen2", tmp_path, vocab_size=300))


def check_parity_and_window(folder, hf) -> None:
    llm = engine_llm(folder, enable_prefix_caching=False)
    try:
        kv = llm.engine.kv
        assert kv.sliding is not None and kv.sliding.window == WINDOW
        logits = record_logits(llm)
        tokens, held, _ = run_one(llm, PROMPT, N_OUT)
        check_against_hf(hf, PROMPT, tokens, torch.cat(logits))
        for computed, full_pages, sliding_pages in held:
            assert full_pages == -(-(computed + 1) // PAGE) or full_pages == -(-computed // PAGE)
            assert sliding_pages <= WINDOW_PAGES + 1
        assert max(h[2] for h in held[-N_OUT // 2:]) <= WINDOW_PAGES
        assert held[-1][1] >= (len(PROMPT) + N_OUT - 2) // PAGE  # the full group keeps it all
        # 75 tokens would need 19 sliding pages: only the window's are held
        assert kv.sliding.pool.num_used == 0  # given back at finish, and no prefix cache
        assert_no_pages_held(llm.engine)
        status = llm.engine.status()["kv"]
        assert status["sliding_group_window"] == WINDOW and status["sliding_pages_used"] == 0
    finally:
        llm.shutdown()


def test_prefix_hits_resume_only_where_the_window_is_held(model) -> None:
    folder, hf = model
    llm = engine_llm(folder)
    try:
        logits = record_logits(llm)
        first, _, cached = run_one(llm, PROMPT, N_OUT)
        assert cached == 0
        check_against_hf(hf, PROMPT, first, torch.cat(logits))
        # A second turn: the first turn's prompt and output are cached, with the last window.
        turn2 = PROMPT + first + [5, 6, 7]
        logits.clear()
        tokens, _, cached = run_one(llm, turn2, 12)
        assert cached == len(PROMPT) + N_OUT - 1
        check_against_hf(hf, turn2, tokens, torch.cat(logits))
        # Diverging three tokens into the second turn: its window is cached at its own end only,
        # so the match falls back to the end of the first turn, whose window is still held.
        branch = PROMPT + first + [5, 6, 8, 8]
        logits.clear()
        tokens, _, cached = run_one(llm, branch, 12)
        assert cached == len(PROMPT) + N_OUT - 1
        check_against_hf(hf, branch, tokens, torch.cat(logits))
        # Diverging inside the first output: no window was cached there (a running sequence's
        # windows reach the cache when it stops), nor at the prompt's end: nothing is usable.
        inside = PROMPT + first[:10] + [9, 8, 7]
        logits.clear()
        tokens, _, cached = run_one(llm, inside, 6)
        assert cached == 0
        check_against_hf(hf, inside, tokens, torch.cat(logits))
        # Diverging mid-prompt, below every held window: nothing is usable.
        early = PROMPT[:20] + [4, 4, 4, 4]
        logits.clear()
        tokens, _, cached = run_one(llm, early, 6)
        assert cached == 0
        check_against_hf(hf, early, tokens, torch.cat(logits))
        assert llm.engine.kv.prefix_hit_tokens == 2 * (len(PROMPT) + N_OUT - 1)
        assert_no_pages_held(llm.engine)
    finally:
        llm.shutdown()


def test_concurrent_conversations_keep_their_windows(model) -> None:
    """Four conversations at once (max_num_seqs 4), two turns each: every second turn resumes
    from the whole first turn (the sliding group's slack holds the windows of the waiting ones),
    without preemption, with the tokens of a run without prefix caching."""
    folder, _ = model
    turn = 12  # tokens per turn
    firsts = [PROMPT[i:] + PROMPT[:i] for i in (0, 9, 18, 27)]
    cold = engine_llm(folder, enable_prefix_caching=False)
    try:
        outs = [o.token_ids for o in cold.generate(firsts, greedy(turn))]
        seconds = [p + o + [5, 6, 7] for p, o in zip(firsts, outs)]
        want = [o.token_ids for o in cold.generate(seconds, greedy(turn))]
    finally:
        cold.shutdown()
    llm = engine_llm(folder)
    try:
        assert [o.token_ids for o in llm.generate(firsts, greedy(turn))] == outs
        got = llm.generate(seconds, greedy(turn))
        assert [o.token_ids for o in got] == want
        assert [o.num_cached_tokens for o in got] == [len(PROMPT) + turn - 1] * 4
        assert llm.engine.scheduler.num_preemptions == 0
        assert_no_pages_held(llm.engine)
    finally:
        llm.shutdown()


def test_preemption_and_abort_leak_no_page(model) -> None:
    """Four long requests in a pool too small for them together (preemption by recompute), one
    aborted mid-decode: the survivors' tokens equal a roomy run's, and both pools end whole."""
    folder, _ = model
    prompts = [PROMPT[i:] + PROMPT[:i] for i in (0, 7, 14, 21)]
    roomy = engine_llm(folder, enable_prefix_caching=False)
    try:
        want = [o.token_ids for o in roomy.generate(prompts, greedy(N_OUT))]
        budget = roomy.engine.runner.kv_bytes_for_pages(40)  # and the sliding group's share
    finally:
        roomy.shutdown()
    llm = engine_llm(folder, kv_cache_memory_bytes=budget)
    try:
        engine = llm.engine
        assert engine.kv.pool.num_pages == 40 < 4 * (len(PROMPT) + N_OUT) // PAGE
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, greedy(N_OUT))
        got: dict[str, list[int]] = {str(i): [] for i in range(4)}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
            steps += 1
            if steps == 12:
                engine.abort_request("3")
        assert engine.scheduler.num_preemptions > 0
        assert [got[str(i)] for i in range(3)] == want[:3]
        assert_no_pages_held(engine)
    finally:
        llm.shutdown()


def test_int8_kv_with_page_groups(model) -> None:
    """int8 KV on both groups: a prefix-cache hit gives the same tokens as a cold run."""
    folder, _ = model
    cold = engine_llm(folder, kv_cache_dtype="int8", enable_prefix_caching=False)
    try:
        turn2 = PROMPT + [11, 12, 13]
        want = cold.generate([turn2], greedy(10))[0].token_ids
    finally:
        cold.shutdown()
    llm = engine_llm(folder, kv_cache_dtype="int8")
    try:
        assert llm.engine.kv.sliding.pool.layout.quantized
        llm.generate([PROMPT], greedy(1))  # cached when it ends: the prompt, window included
        out = llm.generate([turn2], greedy(10))[0]
        assert out.num_cached_tokens == len(PROMPT) and out.token_ids == want
        assert_no_pages_held(llm.engine)
    finally:
        llm.shutdown()



def test_speculative_decoding_over_page_groups(model) -> None:
    """n-gram drafts verified over both groups' tables, rejected ones trimmed from both: the
    same tokens as without speculation, with drafts really accepted, and no page leaked."""
    folder, _ = model
    prompt = PROMPT[:20] * 3  # repeats itself, so the lookup finds drafts
    plain = engine_llm(folder)
    try:
        want = plain.generate([prompt, PROMPT], greedy(N_OUT))
    finally:
        plain.shutdown()
    spec = engine_llm(folder, speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}))
    try:
        got = spec.generate([prompt, PROMPT], greedy(N_OUT))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        stats = spec.engine.spec_stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
        assert_no_pages_held(spec.engine)
    finally:
        spec.shutdown()


def test_two_ranks_run_the_page_groups(tmp_path) -> None:
    """TP=2 (two gloo ranks): the sliding group's slots and tables travel in the step plan and
    its copies run on both ranks; greedy tokens equal TP=1's, prefix hit included."""
    folder = tmp_path / "gemma3"
    make_sliding_model("gemma3", folder, vocab_size=300, num_attention_heads=4, num_key_value_heads=2)
    turn2 = PROMPT + [5, 6, 7]
    runs = []
    for tp in (1, 2):
        llm = engine_llm(folder, tensor_parallel_size=tp)
        try:
            runs.append([llm.generate([p], greedy(n))[0] for p, n in ((PROMPT, 1), (turn2, 12))])
            assert_no_pages_held(llm.engine)
        finally:
            llm.shutdown()
    one, two = runs
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert two[1].num_cached_tokens == len(PROMPT)
