"""Body handling that keeps one request from occupying the server: the size cap (413), JSON-only
bodies (415), the prompt-length bound decided before tokenizing, tokenization off the event
loop (/health answers while a tokenizer is stuck), the prompts x n cap, and a client that hangs
up during submission leaving nothing behind. Timing is by events the test controls, never by
wall-clock rates."""

from __future__ import annotations

import http.client
import json
import socket
import threading

import httpx
import pytest

from tests.server.conftest import fake_server
from tests.server.fake_engine import FakeEngine, FakeTokenizer
from tests.server.harness import wait_for

USER = [{"role": "user", "content": "hi"}]


class GatedTokenizer(FakeTokenizer):
    """Counts encode calls; texts containing BLOCK wait in encode until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        if "BLOCK" in text:
            self.entered.set()
            assert self.release.wait(20), "the test never released the tokenizer"
        return super().encode(text, add_special_tokens)


def test_body_over_the_cap_is_413_declared_or_chunked() -> None:
    with fake_server(max_request_body_bytes=4096) as running:
        url = f"{running.base_url}/v1/completions"
        big = json.dumps({"prompt": "x" * 5000}).encode()
        r = httpx.post(url, content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert "4096" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the cap must hold while reading
            for _ in range(10):
                yield b" " * 1000
        r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        ok = httpx.post(url, json={"prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_json_routes_require_a_json_content_type(server, engine, content_type) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    headers = {"content-type": content_type} if content_type else {}
    steps = engine.steps
    r = httpx.post(f"{server.base_url}/v1/completions", content=body, headers=headers)
    assert r.status_code == 415, r.text
    assert "application/json" in r.json()["error"]["message"]
    assert engine.steps == steps  # never parsed, never run
    charset = httpx.post(f"{server.base_url}/v1/completions", content=body,
                         headers={"content-type": "application/json; charset=utf-8"})
    assert charset.status_code == 200


def test_absurd_prompts_are_refused_before_tokenizing() -> None:
    tokenizer = GatedTokenizer()
    with fake_server(lambda: FakeEngine(tokenizer=tokenizer)) as running:
        # The fake's longest token is 5 bytes ("<pad>"): 1024 tokens hold at most 10,240 chars.
        limit = 1024 * 5 * 2
        base = running.base_url
        calls = tokenizer.calls
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "y" * (limit + 1)})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded"
        assert str(limit) in err["message"] and "1024" in err["message"]
        r = httpx.post(f"{base}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "y" * (limit + 1)}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = httpx.post(f"{base}/tokenize", json={"prompt": "y" * (limit + 1)})
        assert r.status_code == 400
        assert tokenizer.calls == calls  # nothing was tokenized


def test_health_answers_while_a_huge_body_is_tokenized() -> None:
    tokenizer = GatedTokenizer()
    # A context so long that the length bound lets 10 MB through to the (stuck) tokenizer.
    with fake_server(lambda: FakeEngine(max_model_len=10**7, tokenizer=tokenizer)) as running:
        result: list[httpx.Response] = []
        body = {"prompt": "BLOCK" + "z" * 10_000_000, "max_tokens": 1}
        sender = threading.Thread(target=lambda: result.append(httpx.post(
            f"{running.base_url}/v1/completions", json=body, timeout=60)), daemon=True)
        sender.start()
        assert tokenizer.entered.wait(30)
        for path in ("/health", "/v1/models"):
            r = httpx.get(f"{running.base_url}{path}", timeout=5)  # would time out on a blocked loop
            assert r.status_code == 200
        assert not tokenizer.release.is_set() and sender.is_alive()
        tokenizer.release.set()
        sender.join(30)
        assert result and result[0].status_code == 400  # 10M tokens + 1 > 10**7
        assert result[0].json()["error"]["code"] == "context_length_exceeded"


def test_tokenize_runs_off_the_event_loop() -> None:
    tokenizer = GatedTokenizer()
    with fake_server(lambda: FakeEngine(tokenizer=tokenizer)) as running:
        result: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: result.append(httpx.post(
            f"{running.base_url}/tokenize", json={"prompt": "BLOCK"}, timeout=30)), daemon=True)
        sender.start()
        assert tokenizer.entered.wait(10)
        assert httpx.get(f"{running.base_url}/health", timeout=5).status_code == 200
        tokenizer.release.set()
        sender.join(10)
        assert result[0].status_code == 200 and result[0].json()["count"] == 6


def test_prompts_times_n_is_capped() -> None:
    with fake_server(max_seqs_per_request=4) as running:
        r = httpx.post(f"{running.base_url}/v1/chat/completions", json={"messages": USER, "n": 5})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "n" and "--max-seqs-per-request" in err["message"]
        r = httpx.post(f"{running.base_url}/v1/completions",
                       json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = httpx.post(f"{running.base_url}/v1/completions",
                       json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4


class GatedAddEngine(FakeEngine):
    """add_request blocks on its third call until the test releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.adds = 0
        self.blocked = threading.Event()
        self.release = threading.Event()

    def add_request(self, request_id, prompt, params) -> None:
        self.adds += 1
        if self.adds == 3:
            self.blocked.set()
            assert self.release.wait(20)
        super().add_request(request_id, prompt, params)


def test_disconnect_during_submission_aborts_what_was_added() -> None:
    engine = GatedAddEngine()
    with fake_server(lambda: engine) as running:
        host, port = running.base_url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": ["p"] * 20, "max_tokens": 500}).encode()
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Content-Type": "application/json"})
        assert engine.blocked.wait(10)
        conn.sock.shutdown(socket.SHUT_RDWR)  # the client hangs up mid-submission
        conn.close()
        # The server notices while the engine thread is still stuck in the third add. Only the
        # handler's abort forgets that third request (the first two may already have finished
        # their 500 tokens on a loaded box, so "at most one left" proved nothing).
        wait_for(lambda: running.state.client.num_unfinished == 0, 5, "the handler to abort")
        engine.release.set()
        status = lambda: httpx.get(f"{running.base_url}/v1/status").json()["requests"]  # noqa: E731
        wait_for(lambda: status() == {"running": 0, "waiting": 0}, 5, "an idle engine")
        assert engine.adds == 3  # the other 17 were never submitted
