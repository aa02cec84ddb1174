"""Speculative decoding on a hybrid (Gated DeltaNet) model: the verify forward moves the recurrent
and conv states over every draft, so rejected drafts must not leave a trace. Greedy output with
n-gram drafts equals the run without, and whenever the drafting run stands at the same computed
token as a never-drafted run, every layer's state is the same."""

from __future__ import annotations

import json

import pytest
import torch

from hybrid_reference import greedy, make_hf_qwen3_5, our_llm

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                    "prompt_lookup_min": 1})
PROMPTS = [[5, 6, 7, 8, 9] * 5, [(7 * i) % 300 + 3 for i in range(30)] * 2, [40, 41, 42]]


class Oracle:
    """Drafts from the known greedy continuation, with a wrong token where the step count says:
    partial acceptance (0..K-1 accepted) and full acceptance both occur."""

    def __init__(self, full: dict[int, list[int]]) -> None:
        self.full = full  # prompt length -> prompt + reference output
        self.calls = 0

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        self.calls += 1
        ref = next(v for v in self.full.values() if v[:len(token_ids)] == token_ids)
        draft = ref[len(token_ids):len(token_ids) + k]
        cut = self.calls % (k + 2)  # k + 1: keep all; else corrupt position `cut`
        if cut < len(draft):
            draft[cut] = (draft[cut] + 1) % 300 + 3
        return draft

    def forget(self, request_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_spec")
    make_hf_qwen3_5(path, seed=3)
    return path


def test_hybrid_ngram_output_equals_no_speculation(folder) -> None:
    plain = our_llm(folder)
    want = [c.token_ids for c in plain.generate(PROMPTS, greedy(16))]
    llm = our_llm(folder, speculative_config=NGRAM)
    assert [c.token_ids for c in llm.generate(PROMPTS, greedy(16))] == want
    assert llm.engine.status()["spec_decode"]["drafts"] > 0
    llm.engine.drafter.proposer = Oracle({len(p): p + w for p, w in zip(PROMPTS, want)})
    assert [c.token_ids for c in llm.generate(PROMPTS, greedy(16))] == want  # snapshots reused
    stats = llm.engine.status()["spec_decode"]
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]  # rejections
    slots = llm.engine.kv.state_slots
    assert slots.running_free == slots.num_running  # backups returned too


def _states(llm, seq) -> list[torch.Tensor]:
    pool = llm.engine.runner.state_pool
    return [t[seq.state_slot].clone() for t in pool.conv_states + pool.ssm_states]


def compare_states_while_running(spec, plain, request_id: str) -> int:
    """Step request `request_id` (added to both engines) to its end in the speculating engine;
    after the first rejection, whenever the plain engine can stand at the same computed token,
    assert every layer's state is the same. Returns how many times it compared."""
    s_seq, p_seq = spec.engine._seqs[request_id], plain.engine._seqs[request_id]
    compared = 0
    while request_id in spec.engine._seqs:
        spec.engine.step()
        stats = spec.engine.spec_stats
        rejected = stats.num_draft_tokens - stats.num_accepted_tokens
        if not rejected or not s_seq.is_decoding:
            continue
        # The next forward applies any queued restore; compare right after a plain decode step.
        while p_seq.num_computed_tokens < s_seq.num_computed_tokens and request_id in plain.engine._seqs:
            plain.engine.step()
        if p_seq.num_computed_tokens == s_seq.num_computed_tokens and not spec.engine.kv.copies.state:
            for a, b in zip(_states(spec, s_seq), _states(plain, p_seq)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            compared += 1
    return compared


def test_state_after_rejections_equals_a_never_drafted_run(folder) -> None:
    spec, plain = our_llm(folder, speculative_config=NGRAM), our_llm(folder)
    prompt = PROMPTS[1]
    want = plain.generate([prompt], greedy(24))[0].token_ids
    spec.engine.drafter.proposer = Oracle({len(prompt): prompt + want})
    for llm in (spec, plain):
        llm.engine.add_request("r", prompt, greedy(24))
    assert compare_states_while_running(spec, plain, "r") >= 1
