"""Acceptance over the real engine: SmolLM2-135M-Instruct (Q4_1 GGUF) on the CPU, one server for
the module, small max_tokens (a decode step takes ~0.1-2 s on a shared 2-core box)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.conftest import openai_client

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol(smollm2_server):
    return smollm2_server


@pytest.fixture
def client(smol) -> openai.OpenAI:
    c = openai_client(smol)
    return c.with_options(timeout=240)


def status(smol) -> dict:
    return httpx.get(f"{smol.base_url}/v1/status", timeout=60).json()


def test_stream_equals_non_stream_at_temperature_0(client: openai.OpenAI) -> None:
    kwargs = dict(model="smollm2", messages=QUESTION, max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].message.content.strip()  # the model says something
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # Greedy: the sampled token is the most likely one (logprobs to float32 rounding, 1e-4).
    for entry in whole.choices[0].logprobs.content:
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.logprob <= 0.0


def test_same_seed_same_sample(client: openai.OpenAI) -> None:
    kwargs = dict(model="smollm2", prompt="Once upon a time", max_tokens=6, temperature=1.0,
                  top_p=0.95, seed=1234)
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b


def test_32_concurrent_streams_finish_with_their_lengths(client: openai.OpenAI) -> None:
    def one(i: int) -> tuple[int, str | None]:
        chunks = list(client.completions.create(
            model="smollm2", prompt=f"Count to {i}:", max_tokens=2 + i % 3, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return chunks[-1].usage.completion_tokens, reasons[0] if len(reasons) == 1 else None

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert results == [(2 + i % 3, "length") for i in range(32)]


def test_disconnect_mid_stream_leaves_nothing_running(smol) -> None:
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 500, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{smol.base_url}/v1/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(lines)
    deadline = time.monotonic() + 1.0 + 3.0  # 1 s promised, plus one in-flight CPU step
    while status(smol)["requests"] != {"running": 0, "waiting": 0}:
        assert time.monotonic() < deadline, status(smol)["requests"]
        time.sleep(0.05)
    assert smol.state.client.num_unfinished == 0


def test_prefix_hits_for_all_shared_tokens(smol, client: openai.OpenAI) -> None:
    tok = smol.state.client.engine.tokenizer
    shared = tok.encode("The quick brown fox jumps over the lazy dog. " * 12)
    assert len(shared) > 100
    first = client.completions.create(model="smollm2", prompt=shared + [tok.encode(" A")[-1]],
                                      max_tokens=1, temperature=0)
    before = status(smol)["prefix_cache"]
    second = client.completions.create(model="smollm2", prompt=shared + [tok.encode(" B")[-1]],
                                       max_tokens=1, temperature=0)
    after = status(smol)["prefix_cache"]
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == len(shared) + 1
    assert second.usage.prompt_tokens_details.cached_tokens == len(shared)
    assert after["hit_tokens"] - before["hit_tokens"] == len(shared)
    metrics = httpx.get(f"{smol.base_url}/metrics", timeout=60).text
    hits = next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("homelab_llm:prefix_cache_hits_total{"))
    assert hits == after["hit_tokens"]


def test_context_limit_error_uses_the_engine_limit(smol) -> None:
    r = httpx.post(f"{smol.base_url}/v1/chat/completions",
                   json={"messages": QUESTION, "max_tokens": 5000}, timeout=60)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "5000" in message and "2048" in message


def test_status_reports_the_real_engine(smol) -> None:
    s = status(smol)
    assert s["config"]["max_model_len"] == 2048
    assert s["kv"]["tokens_capacity"] >= 2048 and s["devices"]
    assert s["throughput"]["generation_tps"] >= 0 and s["uptime"] > 0
    assert s["latency"]["ttft_p50"] is not None and s["latency"]["ttft_p50"] > 0
