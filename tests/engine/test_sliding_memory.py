"""Engine-level KV memory of an all-sliding model (tiny Mistral, window 8, dummy weights): a long
sequence holds about a window of pages, released pages return to the pool, the prefix cache keeps
whole prompts, and generation is token-for-token the same as with every page kept."""

from __future__ import annotations

import json
from pathlib import Path

from homelab_llm.engine.llm import LLM
from homelab_llm.engine.sampling_params import SamplingParams
from tests.engine.engine_fixtures import TINY_LLAMA

WINDOW, PAGE = 8, 4
PROMPT = [(13 * i + 5) % 300 + 3 for i in range(30)]


def _llm(tmp: Path, window: int | None, **kw) -> LLM:
    path = tmp / f"mistral-{window}.json"
    cfg = {**TINY_LLAMA, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
           "sliding_window": window}
    path.write_text(json.dumps(cfg))
    args = dict(load_format="dummy", device="cpu", dtype="float32", page_size=PAGE,
                kv_cache_memory_bytes=1 << 20, seed=0)
    args.update(kw)
    return LLM(str(path), **args)


def _run(llm: LLM, prompt: list[int], n: int) -> tuple[list[int], list[int]]:
    """Greedy tokens and, after every step, how many pages the sequence still holds."""
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    held, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
        for seq in engine.scheduler.running:
            held.append(len(seq.page_table) - seq.released_pages)
    return tokens, held


def test_long_sequence_holds_a_window_of_pages(tmp_path: Path) -> None:
    llm = _llm(tmp_path, WINDOW, enable_prefix_caching=False)
    pool = llm.engine.kv.pool
    free_before = pool.num_free
    tokens, held = _run(llm, PROMPT, 40)
    assert len(tokens) == 40
    # a window of 8 tokens spans at most 3 pages of 4, plus the page the next token goes to
    assert max(held[-20:]) <= WINDOW // PAGE + 2
    assert pool.num_free == free_before  # everything came back at finish
    llm.shutdown()


def test_same_tokens_as_without_release_and_prefix_hit(tmp_path: Path) -> None:
    """The window-released run, then the same prompt again (a prefix-cache hit on the whole
    prompt) give the same tokens as a run that keeps every page (no release: caching off, the
    window still applied by the kernels)."""
    llm = _llm(tmp_path, WINDOW)
    first, held = _run(llm, PROMPT, 30)
    assert max(held[-10:]) < len(PROMPT) // PAGE  # pages were released past the prompt
    engine = llm.engine
    hits_before = engine.kv.prefix_hit_tokens
    again, _ = _run(llm, PROMPT, 30)
    assert engine.kv.prefix_hit_tokens - hits_before >= len(PROMPT) - PAGE
    llm.shutdown()
    keep = _llm(tmp_path, WINDOW, enable_prefix_caching=False)
    keep.engine.kv.release_window = 0
    want, held_all = _run(keep, PROMPT, 30)
    keep.shutdown()
    assert held_all[-1] >= (len(PROMPT) + 29) // PAGE
    assert first == want and again == want
