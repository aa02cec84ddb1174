"""Tool calls written as bare JSON: Llama 3's and Mistral's formats (vLLM's `llama3_json` and
`mistral` parsers).

    llama3_json   [<|python_tag|>]{"name": "f", "parameters": {...}}; {"name": "g", ...}
                  The reply is calls only when it starts (after whitespace) with the tag or `{`;
                  otherwise it is all content.
    mistral       text [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
                  text [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}   (tokenizers v11+)

Streaming emits each call whole once its JSON closes, so the calls of a text are the same however
it is cut. Text that breaks the format (bad JSON, an object that is not a call, a name with
spaces) stays in the content from that point on, exactly as the model wrote it: calls already
emitted stand, nothing is dropped.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from homelab_llm.server.text_scan import json_value_end, split_holdback
from homelab_llm.server.tool_call import ContentGate, ToolCall, ToolDelta, call_from_obj, parse_call

PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")

Scan = tuple[Literal["wait", "ok", "bad"], list[ToolCall], int]  # (verdict, calls, end of them)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _json_at(text: str, i: int) -> tuple[object, int] | None | Literal["bad"]:
    """The JSON value opening at text[i] and its end; None while open; "bad" if not JSON."""
    end = json_value_end(text, i)
    if end is None:
        return None
    try:
        return json.loads(text[i:end]), end
    except json.JSONDecodeError:
        return "bad"


class Llama3JsonToolParser(ContentGate):
    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._mode: Literal["start", "call", "content"] = "start"

    def push(self, delta: str) -> ToolDelta:
        self._buffer += delta
        out = ToolDelta()
        while self._buffer:
            if self._mode == "content":
                self.emit(self._buffer, out)
                self._buffer = ""
            elif self._mode == "start":
                head = self._buffer.lstrip()
                if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                    break  # all space, or maybe the tag: the next delta decides
                if head.startswith(PYTHON_TAG):
                    self._buffer, self._mode = head[len(PYTHON_TAG):], "call"
                else:
                    self._mode = "call" if head.startswith("{") else "content"
            else:
                # The buffer is kept whole until a call is read, so a failed one is content as written.
                i = _skip_space(self._buffer, 0)
                if self.calls and i < len(self._buffer):  # after a call: `;` before the next
                    if self._buffer[i] != ";":
                        self._mode = "content"
                        continue
                    i = _skip_space(self._buffer, i + 1)
                if i == len(self._buffer):
                    break
                end = json_value_end(self._buffer, i) if self._buffer[i] == "{" else -1
                if end is None:
                    break
                call = parse_call(self._buffer[i:end]) if end > 0 else None
                if call is None:
                    self._mode = "content"
                    continue
                self.add_call(call, out)
                self._buffer = self._buffer[end:]
        return out

    def flush(self) -> ToolDelta:
        """End of output: an unfinished call or a partial tag is plain content; space (or a
        lone `;`) after the last call is not."""
        text, self._buffer = self._buffer, ""
        trailing = self._mode == "call" and self.calls and text.strip() in ("", ";")
        return self.end("" if trailing else text)


def _mistral_call(text: str) -> Scan:
    """Read the call(s) after the [TOOL_CALLS] that opens `text`."""
    i = _skip_space(text, len(TOOL_CALLS))
    if i == len(text):
        return "wait", [], 0
    if text[i] in "[{":  # a JSON list of calls (or one call object)
        value = _json_at(text, i)
        if value is None:
            return "wait", [], 0
        if value == "bad":
            return "bad", [], 0
        obj, end = value
        items = obj if isinstance(obj, list) else [obj]
        calls = [call_from_obj(item) for item in items]
        if not calls or any(c is None for c in calls):
            return "bad", [], 0
        return "ok", calls, end
    at = text.find(ARGS, i)
    if at < 0:  # still reading the name (or the name is broken)
        name_part, _ = split_holdback(text[i:], ARGS)
        return ("wait" if _NAME.fullmatch(name_part) else "bad"), [], 0
    name = text[i:at]
    j = _skip_space(text, at + len(ARGS))
    if not name or not _NAME.fullmatch(name):
        return "bad", [], 0
    if j == len(text):
        return "wait", [], 0
    value = _json_at(text, j) if text[j] == "{" else "bad"
    if value is None:
        return "wait", [], 0
    call = call_from_obj({"name": name, "arguments": value[0]}) if value != "bad" else None
    return ("ok", [call], value[1]) if call is not None else ("bad", [], 0)


class MistralToolParser(ContentGate):
    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""

    def push(self, delta: str) -> ToolDelta:
        self._buffer += delta
        out = ToolDelta()
        while self._buffer:
            start = self._buffer.find(TOOL_CALLS)
            if start < 0:
                emit, self._buffer = split_holdback(self._buffer, TOOL_CALLS)
                self.emit(emit, out)
                break
            self.emit(self._buffer[:start], out)
            self._buffer = self._buffer[start:]
            verdict, calls, end = _mistral_call(self._buffer)
            if verdict == "wait":
                break
            if verdict == "bad":  # the tag is text; what follows it is scanned again
                self.emit(TOOL_CALLS, out)
                self._buffer = self._buffer[len(TOOL_CALLS):]
                continue
            for call in calls:
                self.add_call(call, out)
            self._buffer = self._buffer[end:]
        return out

    def flush(self) -> ToolDelta:
        """End of output: an unfinished call or a partial tag is plain content."""
        text, self._buffer = self._buffer, ""
        return self.end(text)
