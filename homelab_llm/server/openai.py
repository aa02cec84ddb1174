"""The OpenAI-compatible routes (and vLLM's /tokenize, /detokenize). Bodies are read and decoded
by body.py, not by FastAPI, so that malformed JSON and wrong types are 400s in OpenAI's error
shape rather than FastAPI's 422s (or 500s)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from homelab_llm.server import body
from homelab_llm.server.chat import create_chat_completion, render_prompt
from homelab_llm.server.completions import check_token_ids, create_completion
from homelab_llm.server.errors import bad_request
from homelab_llm.server.limits import PromptBound, check_body_shape
from homelab_llm.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                         DetokenizeRequest, TokenizeRequest, encode_text,
                                         parse_body)
from homelab_llm.server.responses import ResponsesRequest, create_response
from homelab_llm.server.state import ServerState

router = APIRouter()


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def read_request(request: Request, model: type[BaseModel]) -> Any:
    """The body as `model`: read and decoded by body.py, counted by check_body_shape, then
    validated (a 400 naming the first bad field)."""
    state = server_state(request)
    data = await body.read_json(request, state.config.max_request_body_bytes)
    engine = state.client.engine
    if engine is not None:  # without one the request is a 503 anyway
        check_body_shape(data, engine.max_model_len, state.config.max_seqs_per_request)
    return parse_body(model, data)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    req = await read_request(request, ChatCompletionRequest)
    return await create_chat_completion(server_state(request), request, req)


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    req = await read_request(request, ResponsesRequest)
    return await create_response(server_state(request), request, req)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    req = await read_request(request, CompletionRequest)
    return await create_completion(server_state(request), request, req)


def _model_card(state: Any, name: str) -> dict[str, Any]:
    engine = state.client.engine
    max_len = engine.max_model_len if engine is not None else None
    return {"id": name, "object": "model", "created": state.created, "owned_by": "homelab-llm",
            "root": state.config.model_path or name, "parent": None, "max_model_len": max_len}


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    state = server_state(request)
    data = [_model_card(state, name) for name in state.config.served_model_names]
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> JSONResponse:
    state = server_state(request)
    return JSONResponse(_model_card(state, state.resolve_model(model_id)))


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    state = server_state(request)
    req: TokenizeRequest = await read_request(request, TokenizeRequest)
    state.resolve_model(req.model)
    engine = state.ready_engine()
    tokenizer = engine.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt or messages", "prompt")
    bound = await state.ready_prompt_bound(engine)
    tokens = await asyncio.to_thread(_tokenize, tokenizer, bound, req)
    out: dict[str, Any] = {"count": len(tokens), "max_model_len": engine.max_model_len,
                           "tokens": tokens}
    if req.return_token_strs:
        out["token_strs"] = [tokenizer.token_text(t) for t in tokens]
    return JSONResponse(out)


def _tokenize(tokenizer: Any, bound: PromptBound, req: TokenizeRequest) -> list[int]:
    if req.messages is not None:
        chat = ChatCompletionRequest(messages=req.messages, tools=req.tools,
                                     add_generation_prompt=req.add_generation_prompt)
        text = render_prompt(tokenizer, chat)
        bound.check(len(text), "messages")
        return encode_text(tokenizer, text, False, "messages")
    assert req.prompt is not None
    bound.check(len(req.prompt), "prompt")
    return encode_text(tokenizer, req.prompt, req.add_special_tokens, "prompt")


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    state = server_state(request)
    req: DetokenizeRequest = await read_request(request, DetokenizeRequest)
    state.resolve_model(req.model)
    tokenizer = state.ready_engine().tokenizer
    check_token_ids(req.tokens, tokenizer.vocab_size, "tokens")
    return JSONResponse({"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)})
