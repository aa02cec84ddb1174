"""gpt-oss's harmony output routed into chat-completion fields: analysis -> reasoning_content,
final -> content, a message to=functions.NAME -> an OpenAI tool call; the same result streamed in
any split of the text."""

from __future__ import annotations

import json
import random

import pytest

from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.server.chat_text import ChatDelta
from homelab_llm.server.harmony import HarmonyRouter, harmony_params, is_harmony

ANSWER = ("<|channel|>analysis<|message|>User wants weather. Call the tool.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>")
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>')


def _streamed(text: str, tools: bool, seed: int) -> ChatDelta:
    router, out = HarmonyRouter(tools), ChatDelta()
    rng, at = random.Random(seed), 0
    while at < len(text):
        n = rng.randint(1, 7)
        d = router.push(text[at:at + n])
        out.reasoning, out.content, out.calls = out.reasoning + d.reasoning, out.content + d.content, out.calls + d.calls
        at += n
    d = router.flush()
    return ChatDelta(out.reasoning + d.reasoning, out.content + d.content, out.calls + d.calls)


def test_reasoning_and_final_answer() -> None:
    router = HarmonyRouter(tools=False)
    out = router.whole(ANSWER)
    assert out.reasoning == "User wants weather. Call the tool."
    assert out.content == "It is sunny in Paris." and not out.calls
    assert router.saw_reasoning and router.num_calls == 0


def test_tool_call_becomes_an_openai_call() -> None:
    router = HarmonyRouter(tools=True)
    out = router.whole(CALL)
    assert out.reasoning == "Need the weather." and out.content == ""
    [call] = out.calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.to_openai()["type"] == "function" and router.num_calls == 1


def test_without_tools_the_call_text_stays_content() -> None:
    out = HarmonyRouter(tools=False).whole(CALL)
    assert not out.calls and out.content == '{"city": "Paris"}'


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text", [ANSWER, CALL])
def test_streaming_in_any_split_gives_the_whole(seed: int, text: str) -> None:
    want = HarmonyRouter(tools=True).whole(text)
    got = _streamed(text, True, seed)
    assert (got.reasoning, got.content) == (want.reasoning, want.content)
    assert [(c.name, c.arguments) for c in got.calls] == [(c.name, c.arguments) for c in want.calls]


def test_unterminated_answer_and_plain_text_are_delivered() -> None:
    out = HarmonyRouter(tools=False).whole("<|channel|>final<|message|>cut off by max_tok")
    assert out.content == "cut off by max_tok"
    assert HarmonyRouter(tools=False).whole("no header at all").content == "no header at all"


def test_detection_and_params() -> None:
    class Tok:
        chat_template = "{{ '<|start|>' }}{{ '<|channel|>' }}{{ '<|message|>' }}"

    class Plain:
        chat_template = "{{ '<|im_start|>' }}"

    assert is_harmony(Tok()) and not is_harmony(Plain()) and not is_harmony(object())
    assert harmony_params(SamplingParams(max_tokens=3)).skip_special_tokens is False
