"""Speculative decoding on a hybrid (Gated DeltaNet) model: the verify forward moves the recurrent
and conv states over every draft, so rejected drafts must not leave a trace. Greedy output with
n-gram drafts equals the run without, and whenever the drafting run stands at the same computed
token as a never-drafted run, every layer's state is the same.

Verify steps run as decode rows in groups of K+1 (step_plan.py, kernels/gdn.py rows_per_seq) and
roll back by keeping the group's rows up to the last kept one pending (cache/verify_slots.py):
right after every verify step, with no copy queued, the sequence's slot with its pending rows
applied (kernels/gdn_pending.replay_slot) is already the never-drafted state."""

from __future__ import annotations

import json

import pytest
import torch

from hybrid_reference import greedy, make_hf_qwen3_5, our_llm, slot_states

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
    assert slots.running_free == slots.num_running


def test_mixed_steps_and_batches_equal_no_speculation(folder) -> None:
    """Verify groups next to prefill chunks (decode rows first, then varlen), several sequences
    verifying in one step, pending rows applied by decode rows of one in steps without drafts
    (max_num_seqs 3, K 3)."""
    prompts = [PROMPTS[1], PROMPTS[0], [9, 8, 7] * 7, PROMPTS[2] * 4]
    kw = dict(max_num_seqs=3, max_num_batched_tokens=24)
    plain = our_llm(folder, **kw)
    want = [c.token_ids for c in plain.generate(prompts, greedy(20))]
    llm = our_llm(folder, speculative_config=NGRAM, **kw)
    llm.engine.drafter.proposer = Oracle({len(p): p + w for p, w in zip(prompts, want)})
    shapes = set()
    llm.engine.runner.fault_hook = lambda batch: shapes.add(
        (batch.context.decode_only, batch.context.verify_width, batch.context.decode_rows > 0))
    assert [c.token_ids for c in llm.generate(prompts, greedy(20))] == want
    assert (True, 4, True) in shapes and (False, 4, True) in shapes  # all-verify and mixed steps
    slots = llm.engine.kv.state_slots
    assert slots.running_free == slots.num_running == 3  # no spare slots
    # disable_by_batch_size 2: drafts only in steps with at most two sequences running, the same
    # output; the step that admits a third sequence drafts nothing, and the two that verified
    # before apply their pending rows as decode rows of one next to its prefill
    bounded = our_llm(folder, speculative_config=json.dumps({**json.loads(NGRAM), "disable_by_batch_size": 2}), **kw)
    bounded.engine.drafter.proposer = Oracle({len(p): p + w for p, w in zip(prompts, want)})
    drafter, steps = bounded.engine.drafter, []
    plain_draft = drafter.draft

    def draft(running) -> None:  # (sequences running, whether any drafted) at each step's drafting
        plain_draft(running)
        steps.append((len(running), any(seq.spec_token_ids for seq in running)))

    drafter.draft = draft
    shapes.clear()
    bounded.engine.runner.fault_hook = llm.engine.runner.fault_hook
    assert [c.token_ids for c in bounded.generate(prompts, greedy(20))] == want
    assert (False, 1, True) in shapes
    assert any(d for _, d in steps) and any(n > 2 for n, _ in steps)
    assert all(n <= 2 for n, d in steps if d)
    assert bounded.engine.kv.state_slots.running_free == 3


def compare_states_while_running(spec, plain, request_id: str) -> tuple[int, int]:
    """Step request `request_id` (added to both engines) to its end in the speculating engine;
    right after every verify step, bring the plain engine to the same computed token and assert
    every layer's state is the same. Returns (steps compared, those with partial acceptance)."""
    s_seq, p_seq = spec.engine._seqs[request_id], plain.engine._seqs[request_id]
    compared = partial = 0
    while request_id in spec.engine._seqs:
        stats = spec.engine.spec_stats
        drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
        spec.engine.step()
        if stats.num_draft_tokens == drafted or request_id not in spec.engine._seqs:
            continue
        # Right after the verify step: no restore, no recompute pending.
        assert s_seq.is_decoding and not spec.engine.kv.copies.state
        while p_seq.num_computed_tokens < s_seq.num_computed_tokens:
            plain.engine.step()
        assert p_seq.num_computed_tokens == s_seq.num_computed_tokens
        for a, b in zip(slot_states(spec, s_seq), slot_states(plain, p_seq)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        compared += 1
        partial += 0 < stats.num_accepted_tokens - accepted < stats.num_draft_tokens - drafted
    return compared, partial


def test_state_after_rejections_equals_a_never_drafted_run(folder) -> None:
    spec, plain = our_llm(folder, speculative_config=NGRAM), our_llm(folder)
    prompt = PROMPTS[1]
    want = plain.generate([prompt], greedy(24))[0].token_ids
    spec.engine.drafter.proposer = Oracle({len(prompt): prompt + want})
    for llm in (spec, plain):
        llm.engine.add_request("r", prompt, greedy(24))
    compared, partial = compare_states_while_running(spec, plain, "r")
    assert compared >= 3 and partial >= 1  # partial acceptance: a middle row kept


def test_tensor_parallel_verify_equals_no_speculation(folder) -> None:
    """Two gloo ranks: the verify plan (groups, state words with pending rows) reaches every rank alike."""
    want = [c.token_ids for c in our_llm(folder).generate(PROMPTS, greedy(12))]
    llm = our_llm(folder, speculative_config=NGRAM, tensor_parallel_size=2)
    try:
        assert [c.token_ids for c in llm.generate(PROMPTS, greedy(12))] == want
        assert llm.engine.status()["spec_decode"]["drafts"] > 0
    finally:
        llm.shutdown()


def test_preempted_with_pending_rows_equals_no_speculation(folder) -> None:
    """A sequence preempted while it holds pending verify rows (forced right after a verify step:
    the scheduler itself stops drafting before pages run out, so it rarely picks one): its prefix
    snapshot applies the rows in the copy and its recompute resumes from that snapshot; once it
    decodes again its state equals a never-drafted run's at the same token (the tiny model's
    tokens barely feel the state), and every output equals the run without speculation."""
    prompts = [PROMPTS[1], PROMPTS[0]]
    want = [c.token_ids for c in our_llm(folder).generate(prompts, greedy(24))]
    llm, plain = our_llm(folder, speculative_config=NGRAM), our_llm(folder)
    engine = llm.engine
    engine.drafter.proposer = Oracle({len(p): p + w for p, w in zip(prompts, want)})
    for e in (engine, plain.engine):
        for i, prompt in enumerate(prompts):
            e.add_request(f"r{i}", prompt, greedy(24))
    got = {"r0": [], "r1": []}
    forced, matched, compared = 0, [], False
    match = engine.kv.match_prefix

    def match_prefix(seq):
        match(seq)
        matched.append((seq.request_id, seq.num_computed_tokens))

    engine.kv.match_prefix = match_prefix
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        seq = engine._seqs.get("r0")
        if not forced and seq is not None and seq.gdn_pending > 1:
            forced = seq.num_computed_tokens
            engine.scheduler.recompute(seq, cache=True)
        elif forced and not compared and seq is not None and seq.is_decoding and seq.state_slot >= 0:
            ref = plain.engine._seqs["r0"]
            while ref.num_computed_tokens < seq.num_computed_tokens:
                plain.engine.step()
            assert ref.num_computed_tokens == seq.num_computed_tokens
            for a, b in zip(slot_states(llm, seq), slot_states(plain, ref)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            compared = True
    assert forced and compared and engine.scheduler.num_preemptions == 1
    assert ("r0", forced) in matched  # resumed from the snapshot taken with its pending rows
    assert [got["r0"], got["r1"]] == want
