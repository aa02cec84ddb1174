"""Chat-completion SSE chunks -> Responses API stream events, in OpenAI's order:

    response.created, response.in_progress,
    [response.output_item.added (message), response.content_part.added,
     response.output_text.delta..., response.output_text.done, response.content_part.done,
     response.output_item.done]
    [per call: response.output_item.added (function_call), response.function_call_arguments.delta,
     response.function_call_arguments.done, response.output_item.done]
    response.completed (or response.incomplete at max_output_tokens; error events pass through)

Every event carries `type` and a running `sequence_number`. A call arrives whole from the tool
parser (it streams a call when its closing tag arrives), so its arguments come as one delta.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

Builder = Callable[[dict[str, Any], str | None, dict[str, int]], dict[str, Any]]


class ResponseEvents:
    def __init__(self, build: Builder) -> None:
        self._build = build  # (message, finish_reason, usage) -> the Response object
        self._seq = 0
        self._text: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._msg_id: str | None = None
        self._finish: str | None = None
        self._started = False
        self.message: dict[str, Any] | None = None  # the assistant turn, once the stream ends

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _message_so_far(self) -> dict[str, Any]:
        return {"role": "assistant", "content": "".join(self._text) or None,
                "tool_calls": list(self._calls) or None}

    def _start(self) -> list[str]:
        self._started = True
        shell = {**self._build({}, None, {}), "status": "in_progress"}
        return [self._event("response.created", response=shell),
                self._event("response.in_progress", response=shell)]

    def _close_text(self) -> list[str]:
        if self._msg_id is None:
            return []
        text, mid = "".join(self._text), self._msg_id
        part = {"type": "output_text", "text": text, "annotations": []}
        item = {"type": "message", "id": mid, "status": "completed", "role": "assistant", "content": [part]}
        self._msg_id = None
        return [self._event("response.output_text.done", item_id=mid, output_index=0, content_index=0, text=text),
                self._event("response.content_part.done", item_id=mid, output_index=0, content_index=0, part=part),
                self._event("response.output_item.done", output_index=0, item=item)]

    def _text_delta(self, delta: str) -> list[str]:
        out = []
        if self._msg_id is None:
            self._msg_id = f"msg_{uuid.uuid4().hex}"
            item = {"type": "message", "id": self._msg_id, "status": "in_progress", "role": "assistant",
                    "content": []}
            out += [self._event("response.output_item.added", output_index=0, item=item),
                    self._event("response.content_part.added", item_id=self._msg_id, output_index=0,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})]
        self._text.append(delta)
        out.append(self._event("response.output_text.delta", item_id=self._msg_id, output_index=0,
                               content_index=0, delta=delta))
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        out = self._close_text()
        index = len(self._calls) + (1 if self._text else 0)
        self._calls.append({"id": call["id"], "type": "function", "function": call["function"]})
        fid, fn = f"fc_{uuid.uuid4().hex}", call["function"]
        item = {"type": "function_call", "id": fid, "call_id": call["id"], "name": fn["name"],
                "arguments": "", "status": "in_progress"}
        done = {**item, "arguments": fn["arguments"], "status": "completed"}
        return out + [self._event("response.output_item.added", output_index=index, item=item),
                      self._event("response.function_call_arguments.delta", item_id=fid,
                                  output_index=index, delta=fn["arguments"]),
                      self._event("response.function_call_arguments.done", item_id=fid,
                                  output_index=index, arguments=fn["arguments"]),
                      self._event("response.output_item.done", output_index=index, item=done)]

    def translate(self, frame: str) -> list[str]:
        """The events for one chat SSE frame (`data: {...}` or `data: [DONE]`)."""
        out = [] if self._started else self._start()
        data = frame.strip().removeprefix("data:").strip()
        if not data or data == "[DONE]":
            return out
        chunk = json.loads(data)
        if "error" in chunk:
            return out + [self._event("error", **chunk["error"])]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        if chunk.get("usage") and not chunk.get("choices"):  # the final usage chunk: the end
            out += self._close_text()
            self.message = self._message_so_far()
            response = self._build(self.message, self._finish, chunk["usage"])
            kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            out.append(self._event(kind, response=response))
        return out
