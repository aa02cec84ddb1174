"""POST /v1/completions: raw prompts (a string, token ids, or a batch of either) times n choices;
choice index = prompt index * n + choice number, as OpenAI numbers them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from homelab_llm.engine.tokenizer import Tokenizer
from homelab_llm.server.errors import bad_request, internal_error
from homelab_llm.server.generation import (Batch, ChoiceState, new_id, output_error,
                                           until_disconnect, usage)
from homelab_llm.server.limits import PromptBound, check_num_seqs
from homelab_llm.server.logprobs import completion_logprobs
from homelab_llm.server.protocol import (CompletionRequest, check_logprobs_cap, check_max_tokens,
                                         encode_text)
from homelab_llm.server.sse import DONE, SSEResponse, sse, sse_error
from homelab_llm.server.state import ServerState
from homelab_llm.server.structured import prepare_grammar


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"{param} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})",
                          param)


def prompt_ids(tokenizer: Tokenizer, prompt: str | list[int], bound: PromptBound) -> list[int]:
    if isinstance(prompt, str):
        bound.check(len(prompt), "prompt")
        ids = encode_text(tokenizer, prompt, True, "prompt")
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        return ids
    check_token_ids(prompt, tokenizer.vocab_size, "prompt")
    return prompt


async def create_completion(state: ServerState, request: Request, req: CompletionRequest) -> Response:
    model = state.resolve_model(req.model)
    req.check()
    logprobs = check_logprobs_cap(req.logprobs_count(), state.config.max_logprobs)
    engine = state.ready_engine()
    tokenizer, max_len = engine.tokenizer, engine.max_model_len
    req.check_token_fields(tokenizer.vocab_size)
    prompts = req.prompts()
    check_num_seqs(len(prompts), req.n, state.config.max_seqs_per_request)
    items, echoes = [], []
    bound = await state.ready_prompt_bound(engine)
    constraint = req.constraint()

    def prepare() -> tuple[list[list[int]], str | None]:  # off the loop: tokenize, compile
        return ([prompt_ids(tokenizer, p, bound) for p in prompts],
                prepare_grammar(tokenizer, constraint))
    all_ids, grammar = await asyncio.to_thread(prepare)
    for prompt, ids in zip(prompts, all_ids):
        max_tokens = check_max_tokens(len(ids), req.requested_max_tokens(), max_len)
        echo = "" if not req.echo else (prompt if isinstance(prompt, str) else tokenizer.decode(ids))
        for i in range(req.n):
            items.append((ids, req.sampling_params(max_tokens, logprobs, i,
                                                   vocab_size=tokenizer.vocab_size, grammar=grammar)))
            echoes.append(echo)
    batch = Batch(state, new_id("cmpl"), items)
    await batch.submit(request)
    ctx = _Context(batch.base_id, int(time.time()), model, tokenizer, logprobs,
                   echoes, [p * req.n for p in range(len(prompts))])
    if req.stream:
        return SSEResponse(_stream(ctx, batch, req.include_usage, req.continuous_usage), on_close=batch.abort)
    try:
        body_out = await until_disconnect(request, _collect(ctx, batch))
    finally:
        batch.abort()
    if body_out is None:
        return Response(status_code=499)
    return JSONResponse(body_out)


class _Context:
    def __init__(self, request_id: str, created: int, model: str, tokenizer: Tokenizer,
                 logprobs: int | None, echoes: list[str], prompt_starts: list[int]) -> None:
        self.id, self.created, self.model = request_id, created, model
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self.echoes, self.prompt_starts = echoes, prompt_starts

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, **extra}


async def _collect(ctx: _Context, batch: Batch) -> dict[str, Any]:
    choices = [ChoiceState(i) for i in range(len(ctx.echoes))]
    async for index, out in batch.outputs():
        if (err := output_error(out)) is not None:
            raise err
        choices[index].update(out)
    result = [{
        "index": c.index, "text": ctx.echoes[c.index] + c.text,
        "logprobs": (completion_logprobs(ctx.tokenizer, c.logprobs, len(ctx.echoes[c.index]))
                     if ctx.logprobs is not None else None),
        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in choices]
    return {**ctx.chunk(result), "usage": usage(choices, ctx.prompt_starts)}


async def _stream(ctx: _Context, batch: Batch, include_usage: bool,
                  continuous_usage: bool) -> AsyncIterator[str]:
    choices = [ChoiceState(i) for i in range(len(ctx.echoes))]

    def extra() -> dict[str, Any]:
        if continuous_usage:
            return {"usage": usage(choices, ctx.prompt_starts)}
        return {"usage": None} if include_usage else {}
    try:
        async for index, out in batch.outputs():
            if (err := output_error(out)) is not None:
                yield sse_error(err)
                yield DONE
                return
            choice = choices[index]
            offset = len(ctx.echoes[index]) + len(choice.text)
            choice.update(out)
            text = out.new_text
            if not choice.started:
                text = ctx.echoes[index] + text
            lp = (completion_logprobs(ctx.tokenizer, out.logprobs, offset)
                  if ctx.logprobs is not None and out.logprobs else None)
            if not text and lp is None and not out.finished and not continuous_usage:
                continue
            choice.started = True
            entry: dict[str, Any] = {"index": index, "text": text, "logprobs": lp,
                                     "finish_reason": choice.finish_reason if out.finished else None}
            if out.finished:
                entry["stop_reason"] = choice.stop_reason
            yield sse(ctx.chunk([entry], **extra()))
        if include_usage:
            yield sse(ctx.chunk([], usage=usage(choices, ctx.prompt_starts)))
        yield DONE
    except Exception as err:  # a bug of ours mid-stream: tell the client (an error id), end cleanly
        yield sse_error(internal_error(err, "completion stream"))
        yield DONE
