"""The OpenAI-compatible endpoints through the official client, over the fake engine."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import fake_server, in_thread_engine, openai_client
from tests.server.fake_engine import FakeEngine, FakeTokenizer

USER = [{"role": "user", "content": "hello there"}]


def stream_text(chunks) -> tuple[str, list]:
    chunks = list(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_chat_non_stream_shape_and_usage(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="fake", messages=USER, max_tokens=12, temperature=0)
    assert out.object == "chat.completion" and out.model == "fake"
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "alpha bravo "
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 12
    prompt_len = len(FakeTokenizer().encode(
        FakeTokenizer().apply_chat_template(USER), add_special_tokens=False))
    assert out.usage.prompt_tokens == prompt_len
    assert out.usage.total_tokens == prompt_len + 12


def test_stream_equals_non_stream_and_chunk_rules(client: openai.OpenAI) -> None:
    kwargs = dict(model="fake", messages=USER, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    text, chunks = stream_text(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    assert text == whole
    assert len({c.id for c in chunks}) == 1
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content  # role travels with the first token
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_stream_ends_with_done(server) -> None:
    body = {"model": "fake", "messages": USER, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_completions_stream_equals_non_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="fake", prompt="once", max_tokens=15, temperature=0)
    assert whole.object == "text_completion"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="fake", prompt="once", max_tokens=15, temperature=0, stream=True))
    assert streamed == whole.choices[0].text and len(streamed) == 15


def test_completions_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    out = client.completions.create(model="fake", prompt="x", temperature=0)
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_completions_token_ids_batch_and_echo(client: openai.OpenAI) -> None:
    tok = FakeTokenizer()
    out = client.completions.create(model="fake", prompt=[tok.encode("ab"), tok.encode("cd")],
                                    max_tokens=4, temperature=0, n=2, echo=True)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text.startswith("ab") and out.choices[2].text.startswith("cd")
    assert out.usage.prompt_tokens == 6  # each prompt counted once, not once per choice
    assert out.usage.completion_tokens == 16


def test_n_choices_seeded_differ_and_replay(client: openai.OpenAI) -> None:
    kwargs = dict(model="fake", messages=USER, max_tokens=16, temperature=1.0, seed=7, n=3)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]  # same seed -> same samples
    assert len(set(texts)) > 1  # choice i uses seed + i
    assert a.usage.completion_tokens == 48


def test_n_choices_streaming(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="fake", messages=USER, max_tokens=5,
                                                 temperature=0, n=2, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == "alpha"
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]


def test_stop_strings_and_stop_reason(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="fake", messages=USER, max_tokens=50,
                                         temperature=0, stop=["charlie"])
    assert out.choices[0].message.content == "alpha bravo "
    assert out.choices[0].finish_reason == "stop"
    streamed, _ = stream_text(client.chat.completions.create(
        model="fake", messages=USER, max_tokens=50, temperature=0, stop="charlie", stream=True))
    assert streamed == "alpha bravo "


def test_eos_min_tokens_ignore_eos(client: openai.OpenAI) -> None:
    say = [{"role": "user", "content": "SAY[[hi]]"}]
    out = client.chat.completions.create(model="fake", messages=say, max_tokens=10)
    assert out.choices[0].message.content == "hi" and out.choices[0].finish_reason == "stop"
    out = client.chat.completions.create(model="fake", messages=say, max_tokens=10,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 10 and out.choices[0].finish_reason == "length"
    out = client.chat.completions.create(model="fake", messages=say, max_tokens=10,
                                         extra_body={"min_tokens": 5})
    assert out.usage.completion_tokens == 6  # 5 forced, then EOS


def test_max_completion_tokens_wins(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="fake", messages=USER, max_tokens=3,
                                         max_completion_tokens=7, temperature=0)
    assert out.usage.completion_tokens == 7


def test_no_max_tokens_generates_to_the_limit() -> None:
    with fake_server(lambda: FakeEngine(max_model_len=80)) as small:
        out = openai_client(small).chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "x"}], temperature=0)
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 80
    assert out.choices[0].finish_reason == "length"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="fake", messages=USER, max_tokens=3, temperature=0,
                                         logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert [e.token for e in content] == ["a", "l", "p"]
    assert content[0].logprob == pytest.approx(-0.5, abs=1e-9)
    assert content[0].bytes == [ord("a")]
    assert len(content[0].top_logprobs) == 2 and content[0].top_logprobs[0].token == "a"
    streamed = list(client.chat.completions.create(model="fake", messages=USER, max_tokens=3,
                                                   temperature=0, logprobs=True, stream=True))
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs
              for e in c.choices[0].logprobs.content]
    assert tokens == ["a", "l", "p"]
    assert all(e.top_logprobs == [] for c in streamed if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content)


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model="fake", prompt="x", max_tokens=3, temperature=0, logprobs=1)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["a", "l", "p"] and lp.text_offset == [0, 1, 2]
    assert lp.token_logprobs == [-0.5] * 3 and lp.top_logprobs[0] == {"a": -0.5}


def test_unknown_fields_are_ignored(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="fake", messages=USER, max_tokens=2,
                                         extra_body={"frobnicate": {"x": 1}, "user": "me",
                                                     "response_format": {"type": "text"}})
    assert out.usage.completion_tokens == 2


def test_sampling_knobs_reach_the_engine(server, client: openai.OpenAI) -> None:
    seen = []
    engine = in_thread_engine(server)
    original = engine.add_request
    engine.add_request = lambda rid, p, params: (seen.append(params),
                                                                     original(rid, p, params))[1]
    try:
        client.chat.completions.create(
            model="fake-alias", messages=USER, max_tokens=2, temperature=0.5, top_p=0.9,
            presence_penalty=0.5, frequency_penalty=-0.5, seed=3,
            extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2})
    finally:
        engine.add_request = original
    p = seen[0]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.5, 0.9, 5, 0.1, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)


def test_models_tokenize_detokenize(server, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake", "fake-alias"]
    r = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "hi"}).json()
    assert r["tokens"] == FakeTokenizer().encode("hi") and r["count"] == 3
    assert r["max_model_len"] == 1024
    r2 = httpx.post(f"{server.base_url}/tokenize", json={"messages": USER}).json()
    assert r2["count"] == len(FakeTokenizer().encode(FakeTokenizer().apply_chat_template(USER),
                                                     add_special_tokens=False))
    back = httpx.post(f"{server.base_url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "<bos>hi"}


def test_concurrent_streams_all_finish(client: openai.OpenAI) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> int:
        chunks = client.chat.completions.create(model="fake", messages=USER, max_tokens=8 + i,
                                                stream=True, stream_options={"include_usage": True})
        return list(chunks)[-1].usage.completion_tokens

    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(one, range(32))) == [8 + i for i in range(32)]


def test_health_and_raw_json_shape(server) -> None:
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    raw = httpx.post(f"{server.base_url}/v1/chat/completions",
                     json={"messages": USER, "max_tokens": 2}).json()
    assert set(raw) == {"id", "object", "created", "model", "choices", "usage"}
    assert raw["id"].startswith("chatcmpl-") and raw["model"] == "fake"  # model defaults
    assert isinstance(raw["usage"]["prompt_tokens_details"]["cached_tokens"], int)
    assert set(raw["choices"][0]) == {"index", "message", "logprobs", "finish_reason", "stop_reason"}


def test_continuous_usage_stats_count_every_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model="fake", prompt="x", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == [1, 2, 3, 4, 5, 6]  # one token per chunk, counted as it arrives
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_continuous_usage_reports_tokens_that_add_no_text(client: openai.OpenAI) -> None:
    # "é" is two byte-tokens in the fake: the first adds no text yet, but still reports its count.
    say = [{"role": "user", "content": "SAY[[éé]]"}]
    chunks = list(client.chat.completions.create(
        model="fake", messages=say, max_tokens=10, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert [c.usage.completion_tokens for c in chunks if c.choices] == [1, 2, 3, 4, 5]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "éé"
    plain = list(client.chat.completions.create(model="fake", messages=say, max_tokens=10,
                                                stream=True))
    assert len([c for c in plain if c.choices]) == 3  # "é", "é", then the finish chunk
