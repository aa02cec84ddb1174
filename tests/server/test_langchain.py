"""Issue 18's LangChain acceptance: LangChain's ChatOpenAI.bind_tools drives our server (SmolLM2
on the CPU) through a two-turn tool conversation: the model calls the tool, LangChain sends the
assistant turn back with empty content plus tool_calls and a ToolMessage with the result, and the
server answers 200 with a final text answer. Nothing leaves the machine: tiktoken (which would
download encodings) is made to fail if called, and sockets may only connect to loopback."""

from __future__ import annotations

import json
import socket

import pytest

from tests.server.conftest import Running

langchain_openai = pytest.importorskip("langchain_openai")
pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiktoken

    def no_download(*args, **kwargs):
        raise AssertionError("tiktoken was called: it would download an encoding")

    monkeypatch.setattr(tiktoken, "get_encoding", no_download)
    monkeypatch.setattr(tiktoken, "encoding_for_model", no_download)
    for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGSMITH_API_KEY", "LANGCHAIN_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    connect = socket.socket.connect

    def loopback_only(self: socket.socket, address) -> None:
        host = address[0] if isinstance(address, tuple) else address
        if self.family in (socket.AF_INET, socket.AF_INET6) and host not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"a connection left the machine: {address}")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)


def test_two_turn_tool_conversation(smollm2_server: Running, offline: None) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    llm = langchain_openai.ChatOpenAI(model="smollm2", base_url=f"{smollm2_server.base_url}/v1",
                                      api_key="unused", temperature=0, max_tokens=40,
                                      max_retries=0, timeout=600)
    question = HumanMessage("What is the weather in Paris?")
    first = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke([question])
    assert isinstance(first, AIMessage) and first.response_metadata["finish_reason"] == "tool_calls"
    call = first.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    result = ToolMessage(json.dumps({"temp_c": 18, "sky": "clear"}), tool_call_id=call["id"])
    final = llm.bind_tools([WEATHER]).invoke([question, first, result], max_tokens=8)
    assert isinstance(final.content, str) and final.content.strip()
    assert final.response_metadata["finish_reason"] in ("stop", "length")
