"""What every tool-call parser shares: the OpenAI tool call, the delta a parser yields per piece of
text, the JSON object -> call rule, and the content gate.

A call object is `{"name": str, "arguments" | "parameters": object | JSON text}` (Hermes, Mistral
and OpenAI write "arguments", Llama 3 writes "parameters"); anything else is not a call, and a
parser then leaves the text in the content rather than dropping it. Trailing whitespace is held
back and only sent when real content follows (or at the end of a reply without calls), so a reply
made of calls has no content, and text cut anywhere gives the same content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


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


class ToolParser(Protocol):
    """A streaming tool-call parser: text pieces in, content and whole calls out. The calls of a
    text are the same however it is cut into pieces."""

    calls: list[ToolCall]

    def push(self, delta: str) -> ToolDelta: ...

    def flush(self) -> ToolDelta: ...


def call_from_obj(obj: Any) -> ToolCall | None:
    """The call a decoded JSON value describes, or None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, (dict, str)):
        return None
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], arguments)


def parse_call(body: str) -> ToolCall | None:
    """The call a JSON text describes, or None (not JSON, or not a call)."""
    try:
        return call_from_obj(json.loads(body))
    except json.JSONDecodeError:
        return None


class ContentGate:
    """Base of the parsers: collects calls, and sends content with inter-call whitespace held."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.pending_space = ""

    def emit(self, text: str, out: ToolDelta) -> None:
        body = text.rstrip()
        if body:
            out.content += self.pending_space + body
            self.pending_space = ""
        self.pending_space += text[len(body):]

    def end(self, rest: str) -> ToolDelta:
        """End of output: `rest` (what a parser still holds) is content; held whitespace is
        content only in a reply without calls."""
        out = ToolDelta()
        self.emit(rest, out)
        if not self.calls:
            out.content += self.pending_space
        self.pending_space = ""
        return out

    def add_call(self, call: ToolCall, out: ToolDelta) -> None:
        self.calls.append(call)
        out.calls.append(call)
