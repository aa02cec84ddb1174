"""POST /v1/chat/completions: template the messages, tokenize, check the context, run n choices,
and answer as one JSON body or as an SSE stream of chunks."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from homelab_llm.engine.structured.grammar import CallWrap
from homelab_llm.engine.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer
from homelab_llm.server.chat_text import ChatDelta, ChatTextRouter
from homelab_llm.server.errors import APIError, bad_request, internal_error
from homelab_llm.server.generation import (Batch, ChoiceState, new_id, output_error,
                                           until_disconnect, usage)
from homelab_llm.server.harmony import HarmonyRouter, harmony_params, is_harmony
from homelab_llm.server.limits import PromptBound, check_num_seqs, message_chars
from homelab_llm.server.logprobs import chat_logprobs
from homelab_llm.server.protocol import (ChatCompletionRequest, check_logprobs_cap, check_max_tokens,
                                         encode_text)
from homelab_llm.server.reasoning_parser import prompt_opens_think
from homelab_llm.server.sse import DONE, SSEResponse, sse, sse_error
from homelab_llm.server.state import ServerState
from homelab_llm.server.structured import prepare_grammar
from homelab_llm.server.tool_parser import tool_format
from homelab_llm.server.tool_template import adapt_messages


def render_prompt(tokenizer: Tokenizer, req: ChatCompletionRequest) -> str:
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools_enabled else None
    template = tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
    messages = adapt_messages(template, req.template_messages(), tools)
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=req.add_generation_prompt,
            **(req.chat_template_kwargs or {}))
    except APIError:
        raise
    except Exception as err:  # jinja2 raises for e.g. roles that do not alternate
        raise bad_request(f"the chat template rejected the messages: {err}", "messages") from err


def _prepare(tokenizer: Tokenizer, req: ChatCompletionRequest, bound: PromptBound,
             call: CallWrap) -> tuple[str, list[int], str | None]:
    # Both length checks are O(1) per message: an absurd prompt is refused before the template
    # runs, and a template-inflated one before the tokenizer does.
    bound.check(message_chars(req.template_messages()), "messages")
    text = render_prompt(tokenizer, req)
    bound.check(len(text), "messages")
    ids = encode_text(tokenizer, text, False, "messages")
    return text, ids, prepare_grammar(tokenizer, req.constraint(call))


def finish_reason(choice: ChoiceState, router: ChatTextRouter) -> str | None:
    if choice.finish_reason == "stop" and router.num_calls:
        return "tool_calls"
    return choice.finish_reason


async def create_chat_completion(state: ServerState, request: Request, req: ChatCompletionRequest) -> Response:
    model = state.resolve_model(req.model)
    req.check()
    logprobs = check_logprobs_cap(req.logprobs_count(), state.config.max_logprobs)
    engine = state.ready_engine()
    tokenizer = engine.tokenizer
    req.check_token_fields(tokenizer.vocab_size)
    check_num_seqs(1, req.n, state.config.max_seqs_per_request)
    # Templating and tokenizing a 100K-token agent prompt takes tens of milliseconds: off the
    # event loop, so other streams keep flowing meanwhile.
    bound = await state.ready_prompt_bound(engine)
    tools = tool_format(state.config.tool_call_parser)
    call = CallWrap(tools.call_open, tools.call_close, tools.args_key)
    prompt_text, prompt_ids, grammar = await asyncio.to_thread(_prepare, tokenizer, req, bound, call)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = check_max_tokens(len(prompt_ids), req.requested_max_tokens(),
                                  engine.max_model_len, param)
    think = state.config.reasoning_parser is not None or bool(getattr(tokenizer, "uses_think_tags", False))
    starts_inside = think and prompt_opens_think(prompt_text)
    harmony = is_harmony(tokenizer)  # gpt-oss: its own output format (server/harmony.py)
    routers: list[Any] = [HarmonyRouter(req.tools_enabled) if harmony else
                          ChatTextRouter(think, starts_inside, req.tools_enabled,
                                         state.config.tool_call_parser) for _ in range(req.n)]
    params = [req.sampling_params(max_tokens, logprobs, i, vocab_size=tokenizer.vocab_size,
                                  grammar=grammar, grammar_after_think=starts_inside)
              for i in range(req.n)]
    if req.tools_enabled and tools.keep_special_tokens:  # the format's markers are special tokens
        params = [dataclasses.replace(p, skip_special_tokens=False) for p in params]
    batch = Batch(state, new_id("chatcmpl"),
                  [(prompt_ids, harmony_params(p) if harmony else p) for p in params])
    await batch.submit(request)
    ctx = _Context(batch.base_id, int(time.time()), model, tokenizer, logprobs)
    if req.stream:
        return SSEResponse(_stream(ctx, batch, routers, req.include_usage, req.continuous_usage), on_close=batch.abort)
    try:
        body_out = await until_disconnect(request, _collect(ctx, batch, routers))
    finally:
        batch.abort()
    if body_out is None:
        return Response(status_code=499)  # the client left; nobody reads this
    return JSONResponse(body_out)


class _Context:
    def __init__(self, request_id: str, created: int, model: str, tokenizer: Tokenizer,
                 logprobs: int | None) -> None:
        self.id, self.created, self.model = request_id, created, model
        self.tokenizer, self.logprobs = tokenizer, logprobs

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices, **extra}


async def _collect(ctx: _Context, batch: Batch, routers: list[ChatTextRouter]) -> dict[str, Any]:
    choices = [ChoiceState(i) for i in range(len(routers))]
    async for index, out in batch.outputs():
        if (err := output_error(out)) is not None:
            raise err
        choices[index].update(out)
    result = []
    for choice, router in zip(choices, routers):
        routed = router.whole(choice.text)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": routed.content or (None if routed.calls else "")}
        if router.saw_reasoning:
            message["reasoning_content"] = routed.reasoning
        if routed.calls:
            message["tool_calls"] = [call.to_openai() for call in routed.calls]
        result.append({
            "index": choice.index, "message": message,
            "logprobs": chat_logprobs(ctx.tokenizer, choice.logprobs) if ctx.logprobs is not None else None,
            "finish_reason": finish_reason(choice, router), "stop_reason": choice.stop_reason})
    return {"id": ctx.id, "object": "chat.completion", "created": ctx.created, "model": ctx.model,
            "choices": result, "usage": usage(choices, [0])}


def _delta(choice: ChoiceState, routed: ChatDelta, calls_before: int) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if not choice.started:  # the role travels with the first token, as OpenAI sends it
        delta["role"] = "assistant"
        delta["content"] = routed.content
    elif routed.content:
        delta["content"] = routed.content
    if routed.reasoning:
        delta["reasoning_content"] = routed.reasoning
    if routed.calls:
        delta["tool_calls"] = [call.to_openai(index=calls_before + k)
                               for k, call in enumerate(routed.calls)]
    return delta


async def _stream(ctx: _Context, batch: Batch, routers: list[ChatTextRouter],
                  include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
    choices = [ChoiceState(i) for i in range(len(routers))]

    def extra() -> dict[str, Any]:
        if continuous_usage:
            return {"usage": usage(choices, [0])}
        return {"usage": None} if include_usage else {}
    try:
        async for index, out in batch.outputs():
            if (err := output_error(out)) is not None:
                yield sse_error(err)
                yield DONE
                return
            choice, router = choices[index], routers[index]
            choice.update(out)
            calls_before = router.num_calls
            routed = router.push(out.new_text)
            if out.finished:
                tail = router.flush()
                routed = ChatDelta(routed.reasoning + tail.reasoning, routed.content + tail.content,
                                   routed.calls + tail.calls)
            lp = (chat_logprobs(ctx.tokenizer, out.logprobs)
                  if ctx.logprobs is not None and out.logprobs else None)
            reason = finish_reason(choice, router) if out.finished else None
            if (not (routed.content or routed.reasoning or routed.calls) and lp is None
                    and reason is None and not continuous_usage):
                continue  # no text yet (a partial character, a tag forming): nothing to say
            delta = _delta(choice, routed, calls_before)
            choice.started = True
            entry: dict[str, Any] = {"index": index, "delta": delta, "logprobs": lp,
                                     "finish_reason": reason}
            if reason is not None:
                entry["stop_reason"] = choice.stop_reason
            yield sse(ctx.chunk([entry], **extra()))
        if include_usage:
            yield sse(ctx.chunk([], usage=usage(choices, [0])))
        yield DONE
    except Exception as err:  # a bug of ours mid-stream: tell the client (an error id), end cleanly
        yield sse_error(internal_error(err, "chat stream"))
        yield DONE
