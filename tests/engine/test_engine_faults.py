"""One request's fault fails that request only; a device fault kills the engine at once.

Faults are injected on the CPU: through the runner's fault_hook (a simulated device error or OOM
during a forward), or through a request whose sampling parameters slipped past validation. The
healthy requests next to a faulty one must produce exactly the tokens they produce alone, and no
KV page may stay held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from homelab_llm.engine.faults import EngineDeadError, FaultKind, SequenceFault, classify
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.scheduler import ScheduledSeq
from tests.engine.engine_fixtures import assert_all_pages_free, prompts, tiny_llm

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=3, ignore_eos=True)


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]], after_add=None) -> dict:
    """Run the requests to the end; {request_id: (token_ids, finish_reason, error)}."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    if after_add is not None:
        after_add(engine)
    got: dict[str, list] = {rid: [[], None, None] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            if out.finished:
                got[out.request_id][1:] = [out.finish_reason, out.error]
    return {rid: tuple(v) for rid, v in got.items()}


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict:
    """Each healthy request's tokens when it runs alone."""
    engine = tiny_llm(tmp_path_factory.mktemp("alone")).engine
    ps = prompts(3, seed=11)
    return {f"ok{i}": run(engine, {f"ok{i}": (p, params)})[f"ok{i}"][0]
            for i, (p, params) in enumerate(zip(ps, (GREEDY, SAMPLED, GREEDY)))}


def healthy() -> dict:
    ps = prompts(3, seed=11)
    return {f"ok{i}": (p, params) for i, (p, params) in enumerate(zip(ps, (GREEDY, SAMPLED, GREEDY)))}


@pytest.mark.parametrize("async_steps", [False, True])
@pytest.mark.parametrize("poison, error", [
    (dict(top_k=2**63), "Overflow"),
    (dict(min_tokens=2, stop_token_ids=[99999]), "IndexError"),
])
def test_a_faulty_sampling_param_fails_its_request_only(tmp_path: Path, alone, poison, error,
                                                        async_steps) -> None:
    engine = tiny_llm(tmp_path).engine
    engine._async = async_steps  # the run-ahead path samples through sample_on_device
    bad = SamplingParams(max_tokens=8, temperature=0.7, ignore_eos=True)
    requests = {**healthy(), "bad": (prompts(1, seed=5)[0], bad)}

    def slip_past_validation(_engine) -> None:
        for key, value in poison.items():
            setattr(bad, key, value)

    got = run(engine, requests, after_add=slip_past_validation)
    assert got["bad"][1] == "error" and error in got["bad"][2]
    for rid, tokens in alone.items():
        assert got[rid] == (tokens, "length", None), rid
    assert_all_pages_free(engine)
    # The engine goes on serving.
    assert run(engine, {"after": healthy()["ok0"]})["after"][0] == alone["ok0"]


def test_a_position_past_the_rope_table_is_a_clear_error_not_a_read(tmp_path: Path, alone) -> None:
    engine = tiny_llm(tmp_path, kv_cache_memory_bytes=1 << 21).engine  # tiny Llama: 512 positions
    assert engine.runner.max_positions == 512
    long = [(5 * i) % 300 + 3 for i in range(505)]

    def let_it_run_past_the_limit(engine) -> None:
        # A bug past admission: the sequence may generate beyond the model's positions.
        engine._seqs["long"].max_tokens = 30
        engine.outputs.max_model_len = 10**6

    requests = {**healthy(), "long": (long, SamplingParams(max_tokens=5, temperature=0.0,
                                                           ignore_eos=True))}
    got = run(engine, requests, after_add=let_it_run_past_the_limit)
    tokens, reason, error = got["long"]
    assert reason == "error" and len(tokens) == 8  # the prefill's token, then positions 505..511
    assert "position 512 is past the RoPE table (512 positions)" in error
    for rid, expected in alone.items():
        assert got[rid][0] == expected
    assert_all_pages_free(engine)


def test_runner_prepare_rejects_a_position_past_the_table(tmp_path: Path) -> None:
    engine = tiny_llm(tmp_path).engine
    engine.add_request("r", [5, 6, 7], GREEDY)
    seq = engine._seqs["r"]
    engine.kv.ensure_pages(seq, 3)
    seq.num_computed_tokens = 0
    seq.token_ids = [5] * 600  # as if it had grown past 512 positions
    engine.kv.ensure_pages(seq, 600)
    with pytest.raises(SequenceFault, match="request r: position 599 is past the RoPE table"):
        engine.runner.prepare([ScheduledSeq(seq, 600)])
    seq.page_table[0] = engine.kv.pool.num_pages + 3  # a page id outside the pool
    with pytest.raises(SequenceFault, match="outside the pool"):
        engine.runner.prepare([ScheduledSeq(seq, 4)])


@pytest.mark.parametrize("message", [
    "CUDA error: an illegal memory access was encountered",
    "HIP error: hipErrorIllegalAddress",
    "CUDA error: uncorrectable ECC error encountered",
    "NCCL error: unhandled system error, remote process exited",
])
def test_a_device_error_kills_the_engine_at_once(tmp_path: Path, message: str) -> None:
    engine = tiny_llm(tmp_path).engine
    for rid, (prompt, params) in healthy().items():
        engine.add_request(rid, prompt, params)
    engine.step()  # healthy first step

    def device_fault(batch) -> None:
        raise RuntimeError(message)

    engine.runner.fault_hook = device_fault
    with pytest.raises(EngineDeadError, match="the engine is dead"):
        engine.step()
    assert engine.dead_reason is not None and message.split(":")[0] in engine.dead_reason
    engine.runner.fault_hook = None
    with pytest.raises(EngineDeadError):  # and stays dead
        engine.step()
    with pytest.raises(EngineDeadError):
        engine.add_request("new", [5, 6, 7], GREEDY)


def test_a_lost_rank_reported_by_the_runner_makes_the_engine_dead(tmp_path: Path) -> None:
    engine = tiny_llm(tmp_path).engine
    engine.runner.failure = "rank 1 exited with code -9"
    assert engine.dead_reason == "rank 1 exited with code -9"
    with pytest.raises(EngineDeadError, match="rank 1 exited"):
        engine.step()


def test_oom_in_one_big_prefill_fails_that_request_only(tmp_path: Path, alone) -> None:
    engine = tiny_llm(tmp_path, max_num_batched_tokens=512).engine
    big = [(3 * i) % 300 + 3 for i in range(300)]

    def oom_on_big_prefills(batch) -> None:
        if batch.context.max_query_len >= 300:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    engine.runner.fault_hook = oom_on_big_prefills
    got = run(engine, {**healthy(), "big": (big, GREEDY)})
    assert got["big"][1] == "error" and "OutOfMemoryError" in got["big"][2]
    for rid, tokens in alone.items():
        assert got[rid] == (tokens, "length", None)
    assert_all_pages_free(engine)
    assert engine.dead_reason is None


def test_oom_in_a_decode_only_step_is_fatal(tmp_path: Path) -> None:
    engine = tiny_llm(tmp_path).engine
    for rid, (prompt, params) in healthy().items():
        engine.add_request(rid, prompt, params)
    engine.step()  # the prefills

    def oom(batch) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    engine.runner.fault_hook = oom
    with pytest.raises(EngineDeadError, match="OutOfMemoryError"):
        engine.step()


def test_an_unexplained_forward_error_is_pinned_to_its_request(tmp_path: Path, alone) -> None:
    engine = tiny_llm(tmp_path).engine
    poison_token = 299  # only the bad prompt holds it

    def fails_on_poison(batch) -> None:
        if bool((batch.input_ids == poison_token).any()):
            raise ValueError("a bug this request triggers")

    engine.runner.fault_hook = fails_on_poison
    got = run(engine, {**healthy(), "bad": ([5, 6, poison_token, 7], GREEDY)})
    assert got["bad"][1] == "error" and "ValueError: a bug this request triggers" == got["bad"][2]
    for rid, tokens in alone.items():
        assert got[rid] == (tokens, "length", None)
    assert_all_pages_free(engine)


def test_classify() -> None:
    assert classify(torch.OutOfMemoryError("CUDA out of memory")) is FaultKind.OOM
    assert classify(RuntimeError("HIP out of memory")) is FaultKind.OOM
    assert classify(RuntimeError("CUDA error: device-side assert triggered")) is FaultKind.FATAL
    assert classify(torch.AcceleratorError("anything")) is FaultKind.FATAL
    assert classify(OverflowError("Overflow when unpacking long long")) is FaultKind.OTHER
    assert classify(IndexError("index 99999 is out of bounds")) is FaultKind.OTHER
    assert classify(ValueError("cuda error in a user string")) is FaultKind.OTHER  # not a runtime error


def test_an_output_processing_fault_fails_its_request_only(tmp_path: Path, alone) -> None:
    engine = tiny_llm(tmp_path).engine
    append = engine.outputs.append_token

    def append_token(seq, token, logprob) -> None:
        if seq.request_id == "bad":
            raise KeyError("detokenizer has no such token")
        append(seq, token, logprob)

    engine.outputs.append_token = append_token
    got = run(engine, {**healthy(), "bad": (prompts(1, seed=9)[0], GREEDY)})
    assert got["bad"][1] == "error" and "KeyError" in got["bad"][2]
    for rid, tokens in alone.items():
        assert got[rid] == (tokens, "length", None)
    assert_all_pages_free(engine)
