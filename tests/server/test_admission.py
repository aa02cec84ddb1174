"""Admission isolates requests: hostile bodies next to a live stream all get OpenAI-shaped 4xx
answers naming the field, the stream ends normally, and the server ends idle. JSON that cannot
be decoded in any way is a 400, and the keep-alive connection survives it."""

from __future__ import annotations

import http.client
import json
import math
import threading

import httpx
import pytest

from homelab_llm.engine.sampling_params import SamplingParams, SamplingParamsError
from tests.server.conftest import fake_server
from tests.server.fake_engine import FakeEngine, FakeTokenizer

USER = [{"role": "user", "content": "hi"}]
VOCAB = FakeTokenizer.vocab_size  # 259


@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("top_p", math.nan),
    ("min_p", math.inf), ("presence_penalty", -math.inf), ("frequency_penalty", math.nan),
    ("repetition_penalty", math.inf), ("top_k", 2**63), ("top_k", VOCAB + 1),
    ("max_tokens", 2**31), ("min_tokens", 2**40), ("seed", 2**63), ("stop_token_ids", [VOCAB]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [2**63]), ("stop_token_ids", [5] * 1025),
    ("stop", ["x"] * 65), ("stop", ["x" * 1025]),
])
def test_sampling_params_validate_against_the_vocabulary(field, value) -> None:
    params = SamplingParams(**{"max_tokens": None, field: value})
    with pytest.raises(SamplingParamsError, match=field):
        params.validate(VOCAB)


def test_sampling_params_accept_the_edges() -> None:
    SamplingParams(top_k=VOCAB, stop_token_ids=[0, VOCAB - 1], seed=2**63 - 1).validate(VOCAB)
    SamplingParams(top_k=-1).validate(VOCAB)
    with pytest.raises(SamplingParamsError, match="top_k"):  # without a vocabulary: int32 bound
        SamplingParams(top_k=2**31).validate()


def raw_post(base: str, path: str, body: bytes | str, content_type: str = "application/json",
             timeout: float = 10) -> httpx.Response:
    data = body.encode() if isinstance(body, str) else body
    return httpx.post(f"{base}{path}", content=data, headers={"content-type": content_type},
                      timeout=timeout)


DEEP = "[" * 100_000 + "]" * 100_000
HOSTILE: list[tuple[str, bytes | str, str, int]] = [
    # (path, raw body, field named in the error (or '' for body-level), status)
    ("/v1/completions", '{"prompt":"hi","max_tokens":4,"top_k":9223372036854775808}', "top_k", 400),
    ("/v1/completions", '{"prompt":"hi","max_tokens":4,"min_tokens":2,"stop_token_ids":[99999]}',
     "stop_token_ids", 400),
    ("/v1/completions", '{"prompt":"hi","max_tokens":4,"stop_token_ids":[9223372036854775808]}',
     "stop_token_ids", 400),
    ("/v1/completions", '{"prompt":"hi","max_tokens":4,"top_k":260}', "top_k", 400),
    ("/v1/completions", '{"prompt":"hi","max_tokens":4,"temperature":NaN}', "", 400),
    ("/v1/completions", '{"prompt":"hi","max_tokens":4,"top_p":Infinity}', "", 400),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"hi"}],"temperature":1e999}',
     "temperature", 400),
    ("/v1/chat/completions",
     '{"messages":[{"role":"user","content":"hi"}],"presence_penalty":-1e400}',
     "presence_penalty", 400),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"hi"}],"min_tokens":1099511627776}',
     "min_tokens", 400),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"hi"}],"logit_bias":{"99999":1}}',
     "logit_bias", 400),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"hi"}],"logit_bias":{"x":1}}',
     "logit_bias", 400),
    ("/v1/completions", '{"prompt":"hi","allowed_token_ids":[5, 259]}', "allowed_token_ids", 400),
    ("/v1/completions", '{"prompt":"hi","n":129}', "n", 400),
    ("/v1/completions", '{"prompt":"hi","seed":18446744073709551616}', "seed", 400),
    ("/v1/completions", json.dumps({"prompt": ["p"] * 100, "n": 3, "max_tokens": 1}), "prompt", 400),
    ("/v1/completions", '{"prompt":"hi","max_tokens":' + "9" * 5000 + "}", "", 400),
    ("/v1/completions", '{"prompt":' + DEEP + "}", "", 400),
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"\xff\xfe"}]}', "", 400),
    ("/tokenize", '{"messages":[]}', "messages", 400),
    ("/detokenize", '{"tokens":[9223372036854775808]}', "tokens", 400),
    # Counted before validation: more messages than the context has tokens, too many prompts.
    ("/v1/chat/completions", json.dumps({"messages": USER * 1025}), "messages", 400),
    ("/v1/completions", json.dumps({"prompt": [[5]] * 257}), "prompt", 400),
    ("/v1/completions", json.dumps({"prompt": [5] * 1025}), "prompt", 400),
    ("/v1/completions", json.dumps({"prompt": "hi", "stop": ["x"] * 65}), "stop", 400),
]


class PausingEngine(FakeEngine):
    """Stops stepping after a few steps until the test says go, so the stream is certainly
    mid-flight while the hostile bodies arrive (and none of them needs the engine thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def step(self):
        if self.steps >= 5:
            assert self.go.wait(30), "the test never resumed the engine"
        return super().step()


def test_hostile_bodies_next_to_a_live_stream() -> None:
    engine = PausingEngine()
    with fake_server(lambda: engine) as running:
        base = running.base_url
        lines: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"messages": USER, "max_tokens": 150, "stream": True}
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert first.wait(10)
        for path, body, field, status in HOSTILE:
            r = raw_post(base, path, body)
            assert r.status_code == status, (path, str(body)[:80], r.text[:300])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            if field:
                assert err["param"] == field and field in err["message"], err
            else:
                assert "not valid JSON" in err["message"], err
        assert lines[-1] != "data: [DONE]", "the stream must still be running meanwhile"
        engine.go.set()
        reader.join(30)
        assert not reader.is_alive()
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert all("error" not in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0]["delta"].get("content") or "") for c in chunks) == 150
        assert running.state.client.num_unfinished == 0
        status = httpx.get(f"{base}/v1/status").json()
        assert status["requests"] == {"running": 0, "waiting": 0}


def test_the_vocabulary_edge_is_served(server) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=10, json={
        "prompt": "hi", "max_tokens": 3, "top_k": VOCAB, "stop_token_ids": [VOCAB - 1],
        "logit_bias": {}, "allowed_token_ids": None})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=10,
                   json={"prompt": "hi", "max_tokens": 3, "logit_bias": {"5": 10}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", '{"prompt":"hi","max_tokens":' + "1" * 5000 + "}"),
    ("/v1/chat/completions", '{"messages":' + DEEP + "}"),
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"\xc3\x28"}]}'),
    ("/tokenize", '{"messages":[]}'),
    ("/v1/completions", "{not json"),
])
def test_malformed_json_is_400_and_the_connection_survives(server, path, body) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        data = body.encode() if isinstance(body, str) else body
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        first = conn.getresponse()
        payload = json.loads(first.read())
        assert first.status == 400, payload
        assert set(payload["error"]) == {"message", "type", "param", "code"}
        sock = conn.sock
        assert sock is not None and not first.will_close
        conn.request("GET", "/health")
        second = conn.getresponse()
        assert second.status == 200 and json.loads(second.read()) == {"status": "ok"}
        assert conn.sock is sock  # the same connection answered
    finally:
        conn.close()
