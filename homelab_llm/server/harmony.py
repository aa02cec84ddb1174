"""gpt-oss's chat format (harmony) in chat completions: the model writes messages of the form

    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>

The prompt side is the model's own chat template (it renders harmony); this is the output side.
`analysis` goes to reasoning_content, `final` (and a commentary message with no recipient, a
preamble) to content, and a message addressed `to=functions.NAME` becomes one OpenAI tool call
with the message body as its arguments. The text must keep harmony's special tokens, so a
harmony request decodes with skip_special_tokens off (`harmony_params`).

HarmonyRouter has ChatTextRouter's interface (push / flush / whole / num_calls / saw_reasoning):
streaming emits reasoning and content as they arrive and a tool call whole when its message ends.
"""

from __future__ import annotations

import dataclasses
import re
import uuid

from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.server.chat_text import ChatDelta
from homelab_llm.server.text_scan import split_holdback
from homelab_llm.server.tool_call import ToolCall

MESSAGE = "<|message|>"
# What ends a message body: end of turn, end of the answer, a tool call, or the next message.
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>")
CHANNEL_RE = re.compile(r"<\|channel\|>\s*(\w+)")
RECIPIENT_RE = re.compile(r"to=([^\s<]+)")


def is_harmony(tokenizer: object) -> bool:
    """The model's chat template writes harmony (gpt-oss's templates name <|channel|>)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "<|channel|>" in template and MESSAGE in template


def harmony_params(params: SamplingParams) -> SamplingParams:
    """The request's sampling params with special tokens kept in the text (see module doc)."""
    return dataclasses.replace(params, skip_special_tokens=False)


class HarmonyRouter:
    def __init__(self, tools: bool) -> None:
        self.tools = tools
        self._buffer = ""
        self._header: str | None = ""  # the current message's header while reading it, else None
        self._channel = "final"
        self._recipient: str | None = None
        self._arguments = ""
        self.num_calls = 0
        self.saw_reasoning = False

    def _open(self, header: str) -> None:
        channel = CHANNEL_RE.search(header)
        recipient = RECIPIENT_RE.search(header)
        self._channel = channel.group(1) if channel else "final"
        self._recipient = recipient.group(1) if recipient else None
        self._arguments = ""
        if self._channel == "analysis":
            self.saw_reasoning = True

    def _body(self, text: str, out: ChatDelta) -> None:
        if not text:
            return
        if self._recipient is not None:
            self._arguments += text
        elif self._channel == "analysis":
            out.reasoning += text
        else:
            out.content += text

    def _close(self, out: ChatDelta) -> None:
        if self._recipient is not None:
            name = self._recipient.removeprefix("functions.")
            if self.tools:
                call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, self._arguments.strip())
                out.calls.append(call)
                self.num_calls += 1
            else:  # no tools were offered: the model's text stays visible
                out.content += self._arguments
        self._recipient = None
        self._header = ""

    def push(self, text: str) -> ChatDelta:
        self._buffer += text
        out = ChatDelta()
        while self._buffer:
            if self._header is not None:  # reading a header up to <|message|>
                at = self._buffer.find(MESSAGE)
                if at < 0:
                    break
                self._open(self._header + self._buffer[:at])
                self._buffer = self._buffer[at + len(MESSAGE):]
                self._header = None
                continue
            ends = [(self._buffer.find(tag), tag) for tag in BODY_ENDS]
            found = [(i, tag) for i, tag in ends if i >= 0]
            if not found:
                emit = self._buffer
                for tag in BODY_ENDS:  # hold back a possibly split end tag
                    emit, held = split_holdback(emit, tag)
                    if held:
                        break
                self._buffer = self._buffer[len(emit):]
                self._body(emit, out)
                break
            at, tag = min(found)
            self._body(self._buffer[:at], out)
            self._buffer = self._buffer[at + len(tag):]
            self._close(out)
            if tag == "<|start|>":
                self._header = "<|start|>"
        return out

    def flush(self) -> ChatDelta:
        """The end of the text: an unterminated body is delivered as it stands (max_tokens, or a
        stop token that is not in the text)."""
        out = ChatDelta()
        if self._header is None:
            self._body(self._buffer, out)
            self._close(out)
        elif not (self._header + self._buffer).lstrip().startswith("<|"):
            out.content += self._header + self._buffer  # plain text, no harmony header at all
        self._buffer = ""
        return out

    def whole(self, text: str) -> ChatDelta:
        a, b = self.push(text), self.flush()
        return ChatDelta(a.reasoning + b.reasoning, a.content + b.content, a.calls + b.calls)
