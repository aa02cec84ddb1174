"""Hermes-style tool calls: the model writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Qwen2.5/3, Hermes, SmolLM2 templates). Each closed block becomes one OpenAI tool call; a block
that is not valid JSON stays in the content, as the model's text, rather than vanishing. Streaming
emits a call whole when its closing tag arrives; the non-streaming answer is the concatenation of
the streamed pieces."""

from __future__ import annotations

from homelab_llm.server.text_scan import split_holdback
from homelab_llm.server.tool_call import ContentGate, ToolDelta, parse_call

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser(ContentGate):
    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._inside = False

    def push(self, delta: str) -> ToolDelta:
        self._buffer += delta
        out = ToolDelta()
        while self._buffer:
            if not self._inside:
                start = self._buffer.find(OPEN)
                if start < 0:
                    emit, self._buffer = split_holdback(self._buffer, OPEN)
                    self.emit(emit, out)
                    break
                self.emit(self._buffer[:start], out)
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
                self.emit(block, out)
            else:
                self.add_call(call, out)
        return out

    def flush(self) -> ToolDelta:
        """End of output: an unclosed block or a held-back partial tag is plain content."""
        text, self._buffer = self._buffer, ""
        return self.end(text)
