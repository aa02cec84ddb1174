"""A fault in the middle of a hybrid model's forward fails its own request only, and the others
still get exactly the tokens they get without it, from the same states.

The Gated DeltaNet layers advance each sequence's recurrent and conv state in place, so a forward
that fails after them has moved the healthy sequences' states one step already: run again, it
would move them twice. LLMEngine._before_retry computes those sequences again from their tokens
instead (Scheduler.recompute). The fault is raised by the last decoder layer, after every GDN
layer ran, whenever a poisoned token is among the step's inputs (the first step that carries it
is a prefill next to the healthy sequences' decodes), with and without speculative decoding.
The tiny model's greedy tokens barely feel its small GDN states, so the states themselves are
compared too: right after the healthy sequences are decoding again, against a run that never
saw the fault at the same computed token (1e-4 relative: recomputed by a prefill vs decoded)."""

from __future__ import annotations

import json

import pytest
import torch

from hybrid_reference import greedy, make_hf_qwen3_5, our_llm, slot_states
from tests.engine.engine_fixtures import assert_all_pages_free

POISON = 299
HEALTHY = {"a": [5, 6, 7, 8, 9] * 3, "b": [(7 * i) % 290 + 3 for i in range(20)]}
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                    "prompt_lookup_min": 1})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_faults")
    make_hf_qwen3_5(path, seed=5)
    return path


def _run(engine, requests: dict[str, list[int]], late: dict[str, list[int]]) -> dict:
    """Healthy requests first; after two steps the late ones join. {id: (tokens, finish, error)}."""
    for rid, prompt in requests.items():
        engine.add_request(rid, prompt, greedy(12))
    got = {rid: [[], None, None] for rid in {**requests, **late}}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 2:
            for rid, prompt in late.items():
                engine.add_request(rid, prompt, greedy(12))
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            if out.finished:
                got[out.request_id][1:] = [out.finish_reason, out.error]
        steps += 1
    return {rid: tuple(v) for rid, v in got.items()}


def _poison(llm) -> list[int]:
    """Make the model's last decoder layer raise whenever the step's inputs hold POISON; returns
    a list that counts the faults."""
    model = llm.engine.runner.model
    seen, faults = [False], []

    def look(_module, args):
        seen[0] = bool((args[0] == POISON).any())

    def fail(_module, _args, _out):
        if seen[0]:
            faults.append(1)
            raise RuntimeError("simulated kernel fault")

    model.register_forward_pre_hook(look)
    model.model.layers[-1].register_forward_hook(fail)
    return faults


def _states_after_the_fault(llm, faults: list[int], plain, rid: str) -> None:
    """Step the faulty engine until `rid` decodes again after the fault; bring the fault-free
    engine to the same computed token; their states must agree."""
    seq, ref = llm.engine._seqs[rid], plain.engine._seqs[rid]
    while not (faults and seq.is_decoding and seq.state_slot >= 0):
        llm.engine.step()
    while ref.num_computed_tokens < seq.num_computed_tokens:
        plain.engine.step()
    assert ref.num_computed_tokens == seq.num_computed_tokens
    for a, b in zip(slot_states(llm, seq), slot_states(plain, ref)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec", [None, NGRAM])
def test_a_fault_after_the_gdn_layers_fails_its_request_only(folder, spec) -> None:
    kw = dict(speculative_config=spec) if spec else {}
    want = _run(our_llm(folder, **kw).engine, HEALTHY, {})
    llm = our_llm(folder, **kw)
    faults = _poison(llm)
    got = _run(llm.engine, HEALTHY, {"bad": [3, 4, POISON, 5]})
    assert faults, "the poisoned request never reached the forward"
    assert got["bad"][1] == "error" and "simulated kernel fault" in got["bad"][2]
    for rid in HEALTHY:
        assert got[rid] == want[rid], rid
    engine = llm.engine
    assert engine.scheduler.num_preemptions >= len(HEALTHY)  # recomputed, not rerun
    slots = engine.kv.state_slots
    assert slots.running_free == slots.num_running
    assert_all_pages_free(engine)
    # the states, stepwise
    llm, plain = our_llm(folder, **kw), our_llm(folder, **kw)
    faults = _poison(llm)
    for engine in (llm.engine, plain.engine):
        for rid, prompt in HEALTHY.items():
            engine.add_request(rid, prompt, greedy(12))
        engine.step()
        engine.step()
    llm.engine.add_request("bad", [3, 4, POISON, 5], greedy(12))
    _states_after_the_fault(llm, faults, plain, "a")
