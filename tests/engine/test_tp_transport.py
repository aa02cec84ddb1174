"""The TP step plan: built on the host it equals what ModelRunner.prepare builds; the shared-memory
and gloo transports give the same tokens; shutdown is clean (workers exit 0 after the barrier, no
timeout path, no ring left in /dev/shm)."""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

import torch

from homelab_llm.engine.llm import LLM
from homelab_llm.engine.parallel.channel import PLAN_TRANSPORT_ENV, ShmPlanChannel
from homelab_llm.engine.parallel.shutdown import SHUTDOWN_WAIT_S
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.step_plan import CMD_ALLOCATE, HEADER_LEN, PlanHeader, build_plan, plan_from_lists
from tests.engine.model_reference import make_hf_model

SHAPE = dict(num_attention_heads=6, num_key_value_heads=2, intermediate_size=192, vocab_size=320)
PROMPTS = [[11, 42, 7, 99, 3, 150, 8], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [77]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _llm(path: Path, tp: int) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=tp, page_size=4,
               kv_cache_memory_bytes=4 << 20, tokenizer=str(path / "config.json"))


def _same_batch(a, b) -> None:
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.num_tokens == b.num_tokens
    ca, cb = a.context, b.context
    for name in ("positions", "slot_mapping", "query_start_loc", "seq_lens", "page_table"):
        x, y = getattr(ca, name), getattr(cb, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    for name in ("max_query_len", "max_seq_len", "page_size", "decode_only", "query_lens_host",
                 "seq_lens_host"):
        assert getattr(ca, name) == getattr(cb, name), name


def test_host_plan_equals_runner_prepare(tmp_path: Path) -> None:
    make_hf_model("llama", tmp_path, **SHAPE)
    llm = _llm(tmp_path, 1)
    e = llm.engine
    try:
        for i, p in enumerate(PROMPTS):
            e.add_request(f"r{i}", p, SamplingParams(max_tokens=4, ignore_eos=True))
        prepare, seen = e.runner.prepare, []

        def checked(scheduled, copies=None):
            batch = prepare(scheduled, copies)
            _same_batch(e.runner.batch_from_plan(*build_plan(scheduled, e.runner.page_size, copies)),
                        batch)
            seen.append(batch.context.decode_only)
            return batch

        e.runner.prepare = checked
        while e.has_unfinished_requests():  # a prefill step, then decode steps
            e.step()
        assert seen[0] is False and seen[-1] is True
    finally:
        llm.shutdown()


def test_shm_and_gloo_plans_give_the_same_tokens_and_shut_down_clean(tmp_path: Path,
                                                                     monkeypatch) -> None:
    make_hf_model("llama", tmp_path, **SHAPE)
    tokens = {}
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    for transport in ("shm", "gloo"):
        monkeypatch.setenv(PLAN_TRANSPORT_ENV, transport)
        llm = _llm(tmp_path, 2)
        runner = llm.engine.runner
        assert isinstance(runner.channel, ShmPlanChannel) == (transport == "shm")
        tokens[transport] = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
        llm.shutdown()
        assert [p.exitcode for p in runner.procs] == [0]  # left through the barrier, not killed
        assert runner.shutdown_seconds < SHUTDOWN_WAIT_S
    assert tokens["shm"] == tokens["gloo"]
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    # Only our rings (rank 0 is this process; other test runs may share /dev/shm meanwhile).
    assert not [n for n in after - before if n.startswith(f"homelab-llm-plan-{os.getpid()}-")]


def test_plan_header_words_round_trip() -> None:
    header, payload = plan_from_lists([5, 6, 7], [0, 1, 2], [8, 9, 10], [3], [3], [[2]], [2])
    assert header.payload_len == payload.numel() and header.decode_only is False
    words = header.to_words()
    assert len(words) == HEADER_LEN and all(type(w) is int for w in words)
    assert PlanHeader.from_words(words) == header
    command = PlanHeader(CMD_ALLOCATE, arg=12)
    assert PlanHeader.from_words(command.to_words()) == command
    named = dict(zip([f.name for f in fields(PlanHeader)], command.to_words()))
    assert named["cmd"] == CMD_ALLOCATE and named["arg"] == 12 and named["num_tokens"] == 0
