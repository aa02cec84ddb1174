"""The --tool-call-parser table: each format's whole-text result, the same result however the
text is cut into streaming deltas (every two-piece split and one character at a time), calls
arriving whole in the delta where their JSON closes, and malformed text falling back to content."""

from __future__ import annotations

import json

import pytest

from homelab_llm.server.chat_text import ChatTextRouter
from homelab_llm.server.text_scan import json_value_end
from homelab_llm.server.tool_parser import TOOL_FORMATS, parse_tool_calls, tool_format

W = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
T = '{"name": "get_time", "arguments": {"tz": "CET", "note": "a } and ] in a string; ok"}}'
OSLO = ("get_weather", {"city": "Oslo"})
TIME = ("get_time", {"tz": "CET", "note": "a } and ] in a string; ok"})

CASES = [
    # llama3_json: tag optional, several calls joined by ';', anything else is all content
    ("llama3_json", f"<|python_tag|>{W}", None, [OSLO]),
    ("llama3_json", f"  {W}; {T}\n", None, [OSLO, TIME]),
    ("llama3_json", f"{W};{T}", None, [OSLO, TIME]),
    ("llama3_json", "It is sunny in Oslo.", "It is sunny in Oslo.", []),
    ("llama3_json", f"Sure: {W}", f"Sure: {W}", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # an object that is not a call
    ("llama3_json", '{"name": "f", "parameters": {bad}}', '{"name": "f", "parameters": {bad}}', []),
    ("llama3_json", f"{W} and then text", " and then text", [OSLO]),
    ("llama3_json", f"{W}; oops", "; oops", [OSLO]),
    ("llama3_json", '{"name": "f", "parameters": {"a": ', '{"name": "f", "parameters": {"a": ', []),
    ("llama3_json", "<|python_ta", "<|python_ta", []),
    # mistral: a JSON list after [TOOL_CALLS], or name[ARGS]{...} per call (tokenizers v11+)
    ("mistral", f"[TOOL_CALLS][{W}, {T}]", None, [OSLO, TIME]),
    ("mistral", f"Let me check. [TOOL_CALLS] [{T}]", "Let me check.", [TIME]),
    ("mistral", "Plain answer.\n", "Plain answer.\n", []),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', None, [OSLO]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]'
                '{"tz": "CET", "note": "a } and ] in a string; ok"}', None, [OSLO, TIME]),
    ("mistral", "No tools needed.", "No tools needed.", []),
    ("mistral", "[TOOL_CALLS][{bad json}]", "[TOOL_CALLS][{bad json}]", []),
    ("mistral", '[TOOL_CALLS][{"nom": 1}]', '[TOOL_CALLS][{"nom": 1}]', []),
    ("mistral", "[TOOL_CALLS]get weather[ARGS]{}", "[TOOL_CALLS]get weather[ARGS]{}", []),
    ("mistral", "[TOOL_CALLS]f[ARGS]nope", "[TOOL_CALLS]f[ARGS]nope", []),
    ("mistral", f"[TOOL_CALLS][{W}", f"[TOOL_CALLS][{W}", []),  # cut off: content
    ("mistral", "[TOOL_CA", "[TOOL_CA", []),
    # hermes still reads what it always did
    ("hermes", f"<tool_call>\n{T}\n</tool_call>", None, [TIME]),
]


def stream(parser: str, pieces: list[str]) -> tuple[str | None, list]:
    router = ChatTextRouter(False, False, True, parser)
    content, calls = "", []
    for piece in pieces + [None]:
        d = router.push(piece) if piece is not None else router.flush()
        content += d.content
        calls += d.calls
    return content or None, calls


def summary(calls: list) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_whole_and_streamed_agree(parser: str, text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = parse_tool_calls(text, parser)
    assert (got_content, summary(got_calls)) == (content, calls)
    assert len({c.id for c in got_calls}) == len(got_calls)
    for cut in range(len(text) + 1):
        got = stream(parser, [text[:cut], text[cut:]])
        assert (got[0], summary(got[1])) == (content, calls), cut
    got = stream(parser, list(text))
    assert (got[0], summary(got[1])) == (content, calls)


@pytest.mark.parametrize("parser, text, closes_at", [
    ("llama3_json", f"{W}; {T}", len(W)),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', None),
    ("mistral", f"[TOOL_CALLS][{W}]", None),
])
def test_a_call_arrives_in_the_delta_that_closes_it(parser: str, text: str, closes_at: int | None) -> None:
    closes_at = len(text) if closes_at is None else closes_at
    router = ChatTextRouter(False, False, True, parser)
    seen = [len(router.push(ch).calls) for ch in text]
    assert sum(seen[:closes_at - 1]) == 0 and seen[closes_at - 1] == 1


def test_registry_is_one_table() -> None:
    assert set(TOOL_FORMATS) == {"hermes", "qwen", "qwen25", "llama3_json", "mistral"}
    assert tool_format(None) is TOOL_FORMATS["hermes"]
    assert TOOL_FORMATS["mistral"].keep_special_tokens and not TOOL_FORMATS["hermes"].keep_special_tokens
    for fmt in TOOL_FORMATS.values():  # a forced call, written as the grammar writes it, parses
        text = fmt.call_open + json.dumps({"name": "f", fmt.args_key: {"x": 1}}) + fmt.call_close
        parser = fmt.make()
        d, tail = parser.push(text), parser.flush()
        assert [(c.name, json.loads(c.arguments)) for c in d.calls + tail.calls] == [("f", {"x": 1})]
        assert (d.content + tail.content).strip() == ""


def test_json_value_end() -> None:
    assert json_value_end('{"a": "}"} x', 0) == 10
    assert json_value_end('[1, {"b": "\\""}]', 0) == 16
    assert json_value_end('{"a": [1, 2', 0) is None


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("parser, said, forced", [
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "[TOOL_CALLS]["),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', '"parameters"'),
])
def test_server_uses_the_configured_parser(parser: str, said: str, forced: str) -> None:
    from tests.server.conftest import fake_server, openai_client

    with fake_server(tool_call_parser=parser) as running:
        client = openai_client(running)
        messages = [{"role": "user", "content": f"SAY[[{said}]]"}]
        out = client.chat.completions.create(model="fake", messages=messages, tools=TOOLS, max_tokens=200)
        call = out.choices[0].message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == OSLO
        assert out.choices[0].finish_reason == "tool_calls" and not out.choices[0].message.content
        chunks = list(client.chat.completions.create(model="fake", messages=messages, tools=TOOLS,
                                                     max_tokens=200, stream=True))
        streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == [OSLO]
        client.chat.completions.create(model="fake", messages=messages, tools=TOOLS, max_tokens=4,
                                       tool_choice="required")
        params = running.state.client.engine.last_params
        assert forced in params.grammar
        assert params.skip_special_tokens is not TOOL_FORMATS[parser].keep_special_tokens
