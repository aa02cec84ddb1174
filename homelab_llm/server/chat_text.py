"""Routes a chat choice's text: `<think>` blocks to reasoning_content (when the template uses
them), then tool calls to tool_calls (when the request has tools; in the format of the
`--tool-call-parser`, Hermes `<tool_call>` blocks by default), the rest to content. Streaming and non-streaming go through the same object."""

from __future__ import annotations

from dataclasses import dataclass, field

from homelab_llm.server.reasoning_parser import ReasoningDelta, ReasoningStream
from homelab_llm.server.tool_call import ToolCall
from homelab_llm.server.tool_parser import tool_format


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ChatTextRouter:
    def __init__(self, think: bool, starts_inside: bool, tools: bool,
                 tool_parser: str | None = None) -> None:
        self.reasoning = ReasoningStream(starts_inside) if think else None
        self.tools = tool_format(tool_parser).make() if tools else None
        self.num_calls = 0

    def _route(self, r: ReasoningDelta, final: bool) -> ChatDelta:
        out = ChatDelta(reasoning=r.reasoning)
        if self.tools is None:
            out.content = r.content
        else:
            t = self.tools.push(r.content)
            out.content, out.calls = t.content, t.calls
            if final:
                tail = self.tools.flush()
                out.content += tail.content
                out.calls += tail.calls
        self.num_calls += len(out.calls)
        return out

    @property
    def saw_reasoning(self) -> bool:
        return self.reasoning is not None and self.reasoning.opened

    def push(self, text: str) -> ChatDelta:
        r = self.reasoning.push(text) if self.reasoning else ReasoningDelta(content=text)
        return self._route(r, final=False)

    def flush(self) -> ChatDelta:
        r = self.reasoning.flush() if self.reasoning else ReasoningDelta()
        return self._route(r, final=True)

    def whole(self, text: str) -> ChatDelta:
        a, b = self.push(text), self.flush()
        return ChatDelta(a.reasoning + b.reasoning, a.content + b.content, a.calls + b.calls)
