"""What agent clients rely on: reasoning_content and Hermes tool calls, streamed and not."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import fake_server, openai_client
from tests.server.fake_engine import FakeEngine, FakeTokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def say(text: str) -> list[dict]:
    return [{"role": "user", "content": f"SAY[[{text}]]"}]


@pytest.fixture(scope="module")
def thinker():
    with fake_server(lambda: FakeEngine(tokenizer=FakeTokenizer(uses_think_tags=True))) as running:
        yield openai_client(running)


def test_tool_calls_non_stream(thinker: openai.OpenAI) -> None:
    out = thinker.chat.completions.create(model="fake", messages=say(f"<think>need data</think>{CALL}"),
                                          tools=TOOLS, max_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == "need data"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}


def test_tool_calls_stream(thinker: openai.OpenAI) -> None:
    chunks = list(thinker.chat.completions.create(
        model="fake", messages=say(f"<think>need data</think>Checking. {CALL}"), tools=TOOLS,
        max_tokens=200, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert reasoning == "need data" and content == "Checking."  # space before a call dropped
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] \
        == ["tool_calls"]


def test_tools_off_leaves_text_alone(thinker: openai.OpenAI) -> None:
    out = thinker.chat.completions.create(model="fake", messages=say(CALL), max_tokens=200)
    assert out.choices[0].message.content == CALL and not out.choices[0].message.tool_calls
    out = thinker.chat.completions.create(model="fake", messages=say(CALL), tools=TOOLS,
                                          tool_choice="none", max_tokens=200)
    assert out.choices[0].message.content == CALL and out.choices[0].finish_reason == "stop"


def test_reasoning_opened_by_the_template(thinker: openai.OpenAI) -> None:
    out = thinker.chat.completions.create(model="fake", messages=say("weigh it</think>Yes."),
                                          max_tokens=100,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert out.choices[0].message.reasoning_content == "weigh it"
    assert out.choices[0].message.content == "Yes."


def test_no_reasoning_routing_when_template_lacks_think() -> None:
    with fake_server() as running:
        out = openai_client(running).chat.completions.create(
            model="fake", messages=say("<think>x</think>y"), max_tokens=100)
    assert out.choices[0].message.content == "<think>x</think>y"
    assert getattr(out.choices[0].message, "reasoning_content", None) is None
