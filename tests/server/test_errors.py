"""Every error a client can cause gets an OpenAI-shaped body and the right status; none is a 500."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import fake_server, openai_client
from tests.server.fake_engine import FakeEngine

USER = [{"role": "user", "content": "hi"}]


def post(server, path: str, body=None, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=10, **kw)


def assert_error(r: httpx.Response, status: int, *needles: str, param: str | None = "skip") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in err["message"], err["message"]
    if param != "skip":
        assert err["param"] == param
    return err


def test_invalid_json_and_non_object(server) -> None:
    r = httpx.post(f"{server.base_url}/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert_error(r, 400, "not valid JSON")
    assert_error(post(server, "/v1/chat/completions", [1, 2]), 400, "JSON object")
    assert_error(post(server, "/v1/completions", "text"), 400, "JSON object")


@pytest.mark.parametrize("body, param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "n": 1.5}, "n"),
    ({"messages": USER, "stream": {"x": 1}}, "stream"),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({"messages": USER, "stop": 5}, "stop"),
])
def test_wrong_types(server, body, param) -> None:
    assert_error(post(server, "/v1/chat/completions", body), 400, param=param)


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2),
    ("presence_penalty", 3), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("n", 0), ("n", 1000), ("max_tokens", 0), ("max_completion_tokens", -1), ("min_tokens", -1),
])
def test_out_of_range(server, field, value) -> None:
    err = assert_error(post(server, "/v1/chat/completions", {"messages": USER, field: value}), 400)
    assert field in err["message"]


def test_min_tokens_above_max_tokens(server) -> None:
    assert_error(post(server, "/v1/chat/completions",
                      {"messages": USER, "max_tokens": 2, "min_tokens": 5}), 400, "min_tokens")


def test_logprob_rules(server) -> None:
    assert_error(post(server, "/v1/chat/completions", {"messages": USER, "top_logprobs": 2}),
                 400, "logprobs", param="top_logprobs")
    assert_error(post(server, "/v1/chat/completions",
                      {"messages": USER, "logprobs": True, "top_logprobs": 21}), 400, "top_logprobs")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "logprobs": 21}), 400, "logprobs")


def test_tool_choice_rules(server) -> None:
    assert_error(post(server, "/v1/chat/completions", {"messages": USER, "tool_choice": "auto"}),
                 400, "tools", param="tool_choice")
    tools = [{"type": "function", "function": {"name": "a", "parameters": {}}}]
    assert_error(post(server, "/v1/chat/completions",
                      {"messages": USER, "tools": tools,
                       "tool_choice": {"type": "function", "function": {"name": "b"}}}), 400, "'b'")


def test_context_length_names_both_numbers_and_limit(server) -> None:
    prompt = "x" * 1000  # 1001 tokens with BOS; the fake serves 1024
    err = assert_error(post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 50}), 400,
                       "1001", "50", "1024")
    assert err["code"] == "context_length_exceeded"
    err = assert_error(post(server, "/v1/chat/completions",
                            {"messages": USER, "max_completion_tokens": 5000}), 400, "5000", "1024",
                       param="max_completion_tokens")
    assert_error(post(server, "/v1/completions", {"prompt": "x" * 1100, "max_tokens": None}),
                 400, "1024")


def test_template_and_token_errors(server) -> None:
    assert_error(post(server, "/v1/chat/completions",
                      {"messages": [{"role": "wizard", "content": "x"}]}), 400, "wizard")
    assert_error(post(server, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                 400, "text parts")
    assert_error(post(server, "/v1/completions", {"prompt": [5, 99999]}), 400, "99999")
    assert_error(post(server, "/v1/completions", {"prompt": []}), 400, "empty")
    assert_error(post(server, "/detokenize", {"tokens": [-1]}), 400, "-1")
    assert_error(post(server, "/tokenize", {}), 400, "prompt")
    assert_error(post(server, "/v1/chat/completions", {"messages": USER, "stop": [""]}), 400, "stop")
    assert_error(post(server, "/v1/chat/completions", {"messages": USER, "seed": 2**64}), 400, "seed")
    lone_surrogate = b'{"prompt": "a\\ud800b", "max_tokens": 2}'  # legal JSON, untokenizable
    r = httpx.post(f"{server.base_url}/v1/completions", content=lone_surrogate,
                   headers={"content-type": "application/json"})
    assert_error(r, 400, "cannot be tokenized", param="prompt")


def test_unknown_model_and_route(server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=USER)
    assert "gpt-9" in info.value.body["message"] and info.value.body["code"] == "model_not_found"
    assert_error(post(server, "/v1/completions", {"model": "nope", "prompt": "x"}), 404, "nope")
    assert_error(httpx.get(f"{server.base_url}/v1/nothing"), 404, "/v1/nothing")
    assert_error(httpx.get(f"{server.base_url}/v1/chat/completions"), 405)


def test_api_key() -> None:
    with fake_server(api_key="sekret") as running:
        assert httpx.get(f"{running.base_url}/health").status_code == 200  # stays open
        with pytest.raises(openai.AuthenticationError):
            openai_client(running, "wrong").models.list()
        r = httpx.post(f"{running.base_url}/v1/chat/completions", json={"messages": USER})
        assert_error(r, 401, "API key")
        assert r.headers["www-authenticate"] == "Bearer"
        assert_error(httpx.get(f"{running.base_url}/v1/status"), 401)
        assert_error(post(running, "/tokenize", {"prompt": "x"}), 401)
        out = openai_client(running, "sekret").chat.completions.create(model="fake", messages=USER,
                                                                       max_tokens=2)
        assert out.usage.completion_tokens == 2


def test_queue_full_is_429_with_retry_after() -> None:
    factory = lambda: FakeEngine(max_num_seqs=1, step_delay=0.02)  # noqa: E731
    with fake_server(factory, max_queue_len=1) as running:
        client = openai_client(running)
        stream = client.chat.completions.create(model="fake", messages=USER, max_tokens=400,
                                                stream=True)
        next(iter(stream))  # running: it has its first token
        waiting = threading.Thread(target=lambda: client.chat.completions.create(
            model="fake", messages=USER, max_tokens=2), daemon=True)
        waiting.start()
        deadline = time.monotonic() + 5
        while running.state.client.num_waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = post(running, "/v1/chat/completions", {"messages": USER, "max_tokens": 2})
        err = assert_error(r, 429, "queue")
        assert r.headers["retry-after"] == "1" and err["type"] == "rate_limit_error"
        stream.close()
        waiting.join(10)
        assert not waiting.is_alive()


def test_loading_is_503_then_ready() -> None:
    release = threading.Event()

    def slow_factory() -> FakeEngine:
        release.wait(10)
        return FakeEngine()

    with fake_server(slow_factory, wait_ready=False) as running:
        r = httpx.get(f"{running.base_url}/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert 0.0 <= r.json()["progress"] <= 1.0 and r.json()["phase"]
        r = post(running, "/v1/chat/completions", {"messages": USER})
        assert_error(r, 503, "loading")
        assert "retry-after" in r.headers
        assert httpx.get(f"{running.base_url}/metrics").status_code == 200
        release.set()
        deadline = time.monotonic() + 5
        while httpx.get(f"{running.base_url}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert post(running, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_load_failure_is_reported() -> None:
    def broken() -> FakeEngine:
        raise RuntimeError("weights are corrupt")

    with fake_server(broken, wait_ready=False) as running:
        deadline = time.monotonic() + 5
        while running.state.client.state == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.get(f"{running.base_url}/health")
        assert r.status_code == 503 and "weights are corrupt" in r.json()["error"]
        assert_error(post(running, "/v1/completions", {"prompt": "x"}), 503, "weights are corrupt")


def test_engine_failure_fails_requests_not_the_server(server) -> None:
    boom = [{"role": "user", "content": "FAIL-STEP"}]
    err = assert_error(post(server, "/v1/chat/completions", {"messages": boom, "max_tokens": 4}),
                       500, "injected step failure")
    assert err["type"] == "server_error"
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions",
                      json={"messages": boom, "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert '"error"' in lines[-2] and "injected step failure" in lines[-2]
    assert lines[-1] == "data: [DONE]"
    ok = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
