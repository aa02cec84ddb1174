"""`<think>...</think>` blocks to `reasoning_content`, for templates that use them (Qwen3,
DeepSeek-R1 style). Some templates open the block in the prompt itself, so the output starts inside
it; the caller says so with `starts_inside`. One stream parser serves both modes: the non-streaming
answer is the concatenation of the streamed pieces, so the two can never disagree."""

from __future__ import annotations

from dataclasses import dataclass

from homelab_llm.server.text_scan import split_holdback

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    def __init__(self, starts_inside: bool = False) -> None:
        self.state = "inside" if starts_inside else "start"  # start | inside | after
        self.opened = starts_inside  # a block was entered (even an empty one)
        self._buffer = ""
        self._strip_content = False  # drop the blank line(s) that follow </think>

    def push(self, delta: str) -> ReasoningDelta:
        self._buffer += delta
        out = ReasoningDelta()
        while self._buffer:
            if self.state == "start":
                # A block counts only at the very start of the output (after whitespace).
                head = self._buffer.lstrip()
                if head.startswith(THINK_OPEN):
                    self._buffer = head[len(THINK_OPEN):]
                    self.state = "inside"
                    self.opened = True
                elif THINK_OPEN.startswith(head):
                    break  # not decided yet
                else:
                    self.state = "after"
            elif self.state == "inside":
                end = self._buffer.find(THINK_CLOSE)
                if end >= 0:
                    out.reasoning += self._buffer[:end]
                    self._buffer = self._buffer[end + len(THINK_CLOSE):]
                    self.state = "after"
                    self._strip_content = True
                else:
                    emit, self._buffer = split_holdback(self._buffer, THINK_CLOSE)
                    out.reasoning += emit
                    break
            else:
                text, self._buffer = self._buffer, ""
                if self._strip_content:
                    text = text.lstrip()
                    self._strip_content = not text
                out.content += text
        return out

    def flush(self) -> ReasoningDelta:
        """End of output: whatever is held back is what it looked like (an unclosed block stays
        reasoning, as the model was cut off while thinking)."""
        text, self._buffer = self._buffer, ""
        if self.state == "inside":
            return ReasoningDelta(reasoning=text)
        if self._strip_content:
            text = text.lstrip()
        return ReasoningDelta(content=text)


def split_reasoning(text: str, starts_inside: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    parser = ReasoningStream(starts_inside)
    a, b = parser.push(text), parser.flush()
    reasoning = a.reasoning + b.reasoning
    saw_block = starts_inside or text.lstrip().startswith(THINK_OPEN)
    return (reasoning if saw_block else None), a.content + b.content


def prompt_opens_think(prompt_text: str) -> bool:
    """True when the rendered prompt ends inside an open <think> block."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)
