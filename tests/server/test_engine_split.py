"""The engine/server split over the real app: with the engine in its own process it streams token
ids only and the server decodes them (server/detokenize.py). A stop string the server finds ends
the request in the engine too, at most one step late, and the client sees exactly what the
in-engine path (the thread mode) gives; a request whose decoding fails, fails alone."""

from __future__ import annotations

import functools
import json
import threading

import httpx
import pytest

from tests.server.conftest import fake_server
from tests.server.fake_engine import OFFSET, FakeEngine, FakeTokenizer
from tests.server.harness import wait_for

STEP_S = 0.25  # the abort, sent when the server sees the stop, lands within this step


def status(base: str) -> dict:
    return httpx.get(f"{base}/v1/status", timeout=10).json()


@pytest.mark.parametrize("engine_process", [True, False])
def test_a_stop_string_ends_the_engine_request_within_one_step(engine_process: bool) -> None:
    factory = functools.partial(FakeEngine, step_delay=STEP_S)
    with fake_server(factory, engine_process=engine_process) as running:
        base = running.base_url
        body = {"prompt": "SAY[[ab STOP cdefghijkl]]", "max_tokens": 30, "stop": ["STOP"]}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("ab ", "stop", "STOP")
        through_stop = len("ab STOP")
        assert usage["completion_tokens"] == through_stop  # never the tokens after the stop
        wait_for(lambda: status(base)["requests"]["running"] == 0, 5, "the engine to drop it")
        extra = status(base)["config"]["fake_generated_tokens"] - through_stop
        assert extra <= (1 if engine_process else 0), extra


def test_streamed_deltas_with_a_stop_string_match_the_thread_mode() -> None:
    body = {"prompt": "SAY[[hello éé world, xyz end]]", "max_tokens": 40, "stop": [", x", "zz"],
            "stream": True, "include_stop_str_in_output": True}
    texts = []
    for engine_process in (True, False):
        with fake_server(engine_process=engine_process) as running:
            with httpx.stream("POST", f"{running.base_url}/v1/completions", json=body,
                              timeout=30) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
        texts.append(("".join(c["choices"][0]["text"] for c in chunks),
                      chunks[-1]["choices"][0]["finish_reason"],
                      chunks[-1]["choices"][0]["stop_reason"]))
    assert texts[0] == texts[1] == ("hello éé world, x", "stop", ", x")


class ExplodingTokenizer(FakeTokenizer):
    """Once armed, has no bytes for "!": the server's decoding of a request that makes it raises.
    (Armed after a first request: the server reads every token's bytes once for its prompt bound.)"""

    armed = False

    def token_bytes(self, token_id: int) -> bytes:
        if self.armed and token_id == ord("!") + OFFSET:
            raise ValueError("no bytes for this token")
        return super().token_bytes(token_id)


def test_a_request_whose_decoding_raises_fails_alone() -> None:
    factory = functools.partial(FakeEngine, step_delay=0.02, tokenizer=ExplodingTokenizer())
    with fake_server(factory, engine_process=True) as running:
        base = running.base_url
        warm = httpx.post(f"{base}/v1/completions", json={"prompt": "SAY[[!]]"}, timeout=30)
        assert warm.json()["choices"][0]["text"] == "!"
        running.state.client.engine.tokenizer.armed = True  # the server's copy, not the engine's
        good: dict = {}

        def run_good() -> None:
            body = {"prompt": "SAY[[all is well, all is well]]", "max_tokens": 40}
            good.update(httpx.post(f"{base}/v1/completions", json=body, timeout=30).json())

        worker = threading.Thread(target=run_good)
        worker.start()
        bad = httpx.post(f"{base}/v1/completions", json={"prompt": "SAY[[oh no!]]", "max_tokens": 40},
                         timeout=30)
        worker.join(30)
        assert bad.status_code == 500
        assert "decoding the output failed: ValueError: no bytes" in bad.json()["error"]["message"]
        assert good["choices"][0]["text"] == "all is well, all is well"
        wait_for(lambda: status(base)["requests"]["running"] == 0, 5, "the engine to drop both")


class BurstEngine(FakeEngine):
    """Three tokens per request per step, as speculative decoding appends accepted drafts."""

    def _advance(self, seq):  # noqa: ANN001, ANN202 - the fake's own signature
        outs = [super()._advance(seq)]
        while len(outs) < 3 and not outs[-1].finished:
            outs.append(super()._advance(seq))
        last = outs[-1]
        last.new_token_ids = [t for o in outs for t in o.new_token_ids]
        last.new_text = "".join(o.new_text for o in outs)
        last.logprobs = [lp for o in outs for lp in o.logprobs]
        return last


@pytest.mark.parametrize("engine_process", [True, False])
def test_several_tokens_of_one_step_stream_as_one_chunk(engine_process: bool) -> None:
    with fake_server(BurstEngine, engine_process=engine_process) as running:
        body = {"prompt": "SAY[[née à Zürich]]", "max_tokens": 40, "stream": True, "logprobs": 1,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        with httpx.stream("POST", f"{running.base_url}/v1/completions", json=body, timeout=30) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    with_choices = [c for c in chunks if c["choices"]]
    tokens = len("SAY[[née à Zürich]]".encode()) - len("SAY[[]]") + 1  # its bytes, then EOS
    assert "".join(c["choices"][0]["text"] for c in with_choices) == "née à Zürich"
    assert [c["usage"]["completion_tokens"] for c in with_choices] == \
        [min(3 * k, tokens) for k in range(1, -(-tokens // 3) + 1)]  # one chunk per step
    streamed_logprobs = [t for c in with_choices for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(streamed_logprobs) == tokens  # one entry per token, EOS's too
