"""Reasoning and tool-call parsers: whole-text results, and the same result however the text is
cut into streaming deltas (every split point, and one character at a time)."""

from __future__ import annotations

import json

import pytest

from homelab_llm.server.chat_text import ChatDelta, ChatTextRouter
from homelab_llm.server.reasoning_parser import prompt_opens_think, split_reasoning
from homelab_llm.server.text_scan import split_holdback
from homelab_llm.server.tool_parser import parse_tool_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_split_holdback() -> None:
    assert split_holdback("abc<too", "<tool_call>") == ("abc", "<too")
    assert split_holdback("abc", "<tool_call>") == ("abc", "")
    assert split_holdback("a<", "<x>") == ("a", "<")
    assert split_holdback("<x", "<x>") == ("", "<x")


@pytest.mark.parametrize("text, inside, expected", [
    ("<think>plan</think>\n\nAnswer.", False, ("plan", "Answer.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("No thinking here <think>x</think>", False, (None, "No thinking here <think>x</think>")),
    ("plan</think>Answer", True, ("plan", "Answer")),
    ("<think>cut off mid thought", False, ("cut off mid thought", "")),
    ("<think></think>Hi", False, ("", "Hi")),
    ("", False, (None, "")),
    ("<thi", False, (None, "<thi")),
])
def test_split_reasoning(text, inside, expected) -> None:
    assert split_reasoning(text, inside) == expected


def test_prompt_opens_think() -> None:
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<think>old</think><|im_start|>assistant\n")
    assert not prompt_opens_think("plain")


def test_tool_calls_whole() -> None:
    content, calls = parse_tool_calls(f"Let me check.\n{CALL}\n{CALL}")
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_tool_calls_bad_json_stays_content() -> None:
    text = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls("<tool_call>{\"no_name\": 1}</tool_call>")[1] == []
    assert parse_tool_calls("<tool_call>{\"name\": \"f\"") == ("<tool_call>{\"name\": \"f\"", [])


def test_tool_call_string_arguments_pass_through() -> None:
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert calls[0].arguments == '{"a": 1}'


def run_stream(router: ChatTextRouter, pieces: list[str]) -> ChatDelta:
    total = ChatDelta()
    for piece in pieces:
        d = router.push(piece)
        total = ChatDelta(total.reasoning + d.reasoning, total.content + d.content, total.calls + d.calls)
    d = router.flush()
    return ChatDelta(total.reasoning + d.reasoning, total.content + d.content, total.calls + d.calls)


TEXT = f"<think>I should call the tool.</think>\n\nSure. {CALL} done <tool"


def summary(d: ChatDelta) -> tuple:
    return d.reasoning, d.content, [(c.name, c.arguments) for c in d.calls]


def test_streaming_equals_whole_at_every_split() -> None:
    whole = summary(ChatTextRouter(True, False, True).whole(TEXT))
    assert whole == ("I should call the tool.", "Sure.  done <tool",
                     [("get_weather", '{"city": "Oslo"}')])
    for cut in range(len(TEXT) + 1):
        assert summary(run_stream(ChatTextRouter(True, False, True), [TEXT[:cut], TEXT[cut:]])) == whole
    assert summary(run_stream(ChatTextRouter(True, False, True), list(TEXT))) == whole


def test_router_without_think_or_tools_is_identity() -> None:
    d = run_stream(ChatTextRouter(False, False, False), list(TEXT))
    assert (d.reasoning, d.content, d.calls) == ("", TEXT, [])
