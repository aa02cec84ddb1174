"""Token-granular prefix reuse on a hybrid (Gated DeltaNet) model: a match resumes from a state
snapshot taken at the end of an earlier prompt or output, and never changes the greedy text.

Reference: the same engine with prefix caching off (its tokens equal transformers', see
test_model_qwen3_5.py). The snapshot pool is bounded; a budget of one snapshot must still give the
same text, only fewer cached tokens.
"""

from __future__ import annotations

import pytest

from hybrid_reference import greedy, make_hf_qwen3_5, our_llm
from homelab_llm.server.metrics import render_metrics
from homelab_llm.server.stats import ServerStats

BASE = [(11 * i + 5) % 300 + 3 for i in range(45)]
EXTENSIONS = [[77], [91, 92, 93], [(3 * i) % 290 + 4 for i in range(17)]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_prefix")
    make_hf_qwen3_5(path, seed=2)
    return path


@pytest.fixture(scope="module")
def reference(folder):
    """Greedy tokens with prefix caching off for BASE, every extension, and a second turn."""
    llm = our_llm(folder, enable_prefix_caching=False)
    try:
        first = llm.generate([BASE], greedy(5))[0].token_ids
        turn2 = BASE + first + [50, 51]
        prompts = [BASE + x for x in EXTENSIONS] + [turn2]
        return first, turn2, [c.token_ids for c in llm.generate(prompts, greedy(5))]
    finally:
        llm.shutdown()


def run(llm, prompt: list[int]) -> tuple[list[int], int]:
    out = llm.generate([prompt], greedy(5))[0]
    return out.token_ids, out.num_cached_tokens


def test_extending_a_prompt_reuses_every_earlier_token(folder, reference):
    first, turn2, ref = reference
    llm = our_llm(folder)
    try:
        assert run(llm, BASE) == (first, 0)
        for x, expected in zip(EXTENSIONS, ref):
            tokens, cached = run(llm, BASE + x)
            assert tokens == expected
            assert cached >= len(BASE), f"extension by {len(x)}: only {cached} cached"
        # A second turn: the first turn's prompt and output (up to its last token) are cached.
        tokens, cached = run(llm, turn2)
        assert tokens == ref[-1] and cached == len(BASE) + len(first) - 1
        status = llm.engine.status()["prefix_cache"]
        assert status["state_snapshot_hits"] >= 4 and status["state_snapshots_held"] > 0
        text = render_metrics(llm.engine.status(), ServerStats(), "m")
        assert "homelab_llm:prefix_cache_state_snapshot_hits_total" in text
    finally:
        llm.shutdown()


def test_tiny_snapshot_budget_never_changes_outputs(folder, reference):
    first, turn2, ref = reference
    llm = our_llm(folder, max_state_snapshots=1)
    try:
        prompts = [BASE] + [BASE + x for x in EXTENSIONS] + [turn2]
        expected = [first] + ref
        for _ in range(2):  # the second round meets whatever snapshot survived the first
            for prompt, want in zip(prompts, expected):
                assert run(llm, prompt)[0] == want
            assert llm.engine.kv.state_slots.snapshots_held <= 1
        e = llm.engine
        assert e.kv.state_slots.running_free == e.kv.state_slots.num_running
    finally:
        llm.shutdown()


def test_no_snapshots_means_no_hybrid_prefix_reuse(folder, reference):
    first, _, _ = reference
    llm = our_llm(folder, max_state_snapshots=0)
    try:
        assert run(llm, BASE) == (first, 0)
        assert run(llm, BASE + [77])[1] == 0 and llm.engine.kv.radix is None
    finally:
        llm.shutdown()
