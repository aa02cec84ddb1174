"""POST /v1/responses (OpenAI's Responses API, used by newer agent clients) over the chat path.

A Responses request becomes a chat request (input items -> messages, flat function tools -> chat
tools, `text.format` -> response_format, `max_output_tokens` -> max_tokens) and runs through
`create_chat_completion`, so templates, tool parsing, structured outputs and limits are the chat
endpoint's. The answer is rebuilt as a Response object, or, streamed, as Responses events
(`response.created`, `response.output_text.delta`, `response.function_call_arguments.done`, ...,
`response.completed`). `previous_response_id`: each stored response keeps its whole conversation
(messages plus its output); a follow-up renders that conversation plus the new input, so its prompt
starts with the previous prompt and output token for token and the radix prefix cache serves it.
The store is in memory, the last STORE_SIZE responses.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from homelab_llm.server.chat import create_chat_completion
from homelab_llm.server.errors import APIError, bad_request
from homelab_llm.server.protocol import ChatCompletionRequest, parse_body
from homelab_llm.server.responses_stream import ResponseEvents
from homelab_llm.server.sse import SSEResponse
from homelab_llm.server.state import ServerState

STORE_SIZE = 1024


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    store: bool = True


def _text(content: Any) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages (consecutive function calls: one assistant turn)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role", "user"), item.get("role", "user"))
            out.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id", ""), "type": "function",
                    "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                        "content": _text(item.get("output"))})
        elif kind != "reasoning":  # our own reasoning items come back: the template drops them
            raise bad_request(f"input[{i}]: items of type {kind!r} are not supported", f"input.{i}")
    return out


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    body: dict[str, Any] = {"model": req.model, "messages": messages + history + input_messages(req.input),
                            "max_tokens": req.max_output_tokens, "temperature": req.temperature,
                            "top_p": req.top_p, "seed": req.seed, "stream": req.stream}
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.get("type") != "function":
                raise bad_request(f"tools[{i}]: only function tools are supported", f"tools.{i}")
            tools.append({"type": "function", "function": {
                k: tool[k] for k in ("name", "description", "parameters") if k in tool}})
        body["tools"] = tools
        choice = req.tool_choice
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.get("name")}}
                               if isinstance(choice, dict) else choice)
    fmt = (req.text or {}).get("format") or {}
    if fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    elif fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    return body


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    items = []
    if message.get("content"):
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed",
                      "role": "assistant", "content": [
                          {"type": "output_text", "text": message["content"], "annotations": []}]})
    for call in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def response_object(rid: str, req: ResponsesRequest, model: str, message: dict[str, Any],
                    finish: str | None, usage: dict[str, int], created: int) -> dict[str, Any]:
    incomplete = finish == "length"
    return {"id": rid, "object": "response", "created_at": created,
            "status": "incomplete" if incomplete else "completed", "model": model,
            "output": output_items(message), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": True,
            "temperature": req.temperature, "top_p": req.top_p, "text": req.text or {"format": {"type": "text"}},
            "metadata": {}, "usage": {
                "input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
                "total_tokens": usage.get("total_tokens", 0),
                "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}


def _store(request: Request) -> OrderedDict[str, list[dict[str, Any]]]:
    app_state = request.app.state
    if not hasattr(app_state, "responses_store"):
        app_state.responses_store = OrderedDict()
    return app_state.responses_store


def _remember(request: Request, rid: str, convo: list[dict[str, Any]], message: dict[str, Any]) -> None:
    """Keep the conversation (without this turn's instructions: OpenAI does not carry them over)
    plus the answer, for a later previous_response_id."""
    turn: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]
    store = _store(request)
    store[rid] = convo + [turn]
    while len(store) > STORE_SIZE:
        store.popitem(last=False)


async def create_response(state: ServerState, request: Request, req: ResponsesRequest) -> Response:
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        found = _store(request).get(req.previous_response_id)
        if found is None:
            raise APIError(404, f"previous response {req.previous_response_id!r} is not stored here",
                           "invalid_request_error", "previous_response_id", "not_found")
        history = found
    body = chat_body(req, history)
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    chat_req: ChatCompletionRequest = parse_body(ChatCompletionRequest, body)
    convo = history + input_messages(req.input)
    rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
    model = state.resolve_model(req.model)
    answer = await create_chat_completion(state, request, chat_req)
    if not req.stream:
        out = json.loads(answer.body)
        choice = out["choices"][0]
        if req.store:
            _remember(request, rid, convo, choice["message"])
        return JSONResponse(response_object(rid, req, model, choice["message"], choice["finish_reason"],
                                            out["usage"], created))
    assert isinstance(answer, SSEResponse)
    events = ResponseEvents(lambda msg, fin, usage: response_object(
        rid, req, model, msg, fin, usage, created))

    async def stream() -> AsyncIterator[str]:
        async for frame in answer.body_iterator:
            for event in events.translate(frame if isinstance(frame, str) else frame.decode()):
                yield event
        if req.store and events.message is not None:
            _remember(request, rid, convo, events.message)

    return SSEResponse(stream(), on_close=answer.on_close)
