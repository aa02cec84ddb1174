"""Hermes-style tool calls: the model writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Qwen2.5/3, Hermes, SmolLM2 templates). Each closed block becomes one OpenAI tool call; a block
that is not valid JSON stays in the content, as the model's text, rather than vanishing. Streaming
emits a call whole when its closing tag arrives; the non-streaming answer is the concatenation of
the streamed pieces."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from homelab_llm.server.text_scan import split_holdback

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], arguments)


class ToolCallStream:
    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False
        self._pending_space = ""  # whitespace between calls is not content worth sending
        self.calls: list[ToolCall] = []

    def _content(self, text: str, out: ToolDelta) -> None:
        if not text:
            return
        if text.strip():
            out.content += self._pending_space + text
            self._pending_space = ""
        else:
            self._pending_space += text

    def push(self, delta: str) -> ToolDelta:
        self._buffer += delta
        out = ToolDelta()
        while self._buffer:
            if not self._inside:
                start = self._buffer.find(OPEN)
                if start < 0:
                    emit, self._buffer = split_holdback(self._buffer, OPEN)
                    self._content(emit, out)
                    break
                self._content(self._buffer[:start], out)
                self._buffer = self._buffer[start:]
                self._inside = True
            end = self._buffer.find(CLOSE)
            if end < 0:
                break
            block = self._buffer[:end + len(CLOSE)]
            self._buffer = self._buffer[end + len(CLOSE):]
            self._inside = False
            call = parse_call(block[len(OPEN):-len(CLOSE)].strip())
            if call is None:
                self._content(block, out)
            else:
                self.calls.append(call)
                out.calls.append(call)
        return out

    def flush(self) -> ToolDelta:
        """End of output: an unclosed block or a held-back partial tag is plain content."""
        out = ToolDelta()
        text, self._buffer = self._buffer, ""
        self._content(text, out)
        return out


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content or None, calls) of a whole output."""
    parser = ToolCallStream()
    a, b = parser.push(text), parser.flush()
    content = a.content + b.content
    return (content or None), a.calls + b.calls
