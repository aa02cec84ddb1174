"""Logprobs in the two shapes OpenAI uses: chat's list of entries, and the legacy completions'
parallel arrays. Token strings come from the tokenizer (`token_text`), bytes from their UTF-8."""

from __future__ import annotations

from typing import Any

from homelab_llm.engine.outputs import TokenLogprob
from homelab_llm.engine.tokenizer import Tokenizer
from homelab_llm.server.generation import clamp_logprob


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_text(token_id)


def _bytes(tokenizer: Tokenizer, token_id: int, text: str) -> list[int]:
    # A token may hold part of a UTF-8 character: its raw bytes say more than its text (U+FFFD).
    raw = getattr(tokenizer, "token_bytes", None)
    return list(raw(token_id)) if raw is not None else list(text.encode())


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict[str, Any]:
    content = []
    for entry in entries:
        text = _text(tokenizer, entry.token_id)
        content.append({
            "token": text, "logprob": clamp_logprob(entry.logprob),
            "bytes": _bytes(tokenizer, entry.token_id, text),
            "top_logprobs": [
                {"token": (t := _text(tokenizer, tid)), "logprob": clamp_logprob(lp),
                 "bytes": _bytes(tokenizer, tid, t)} for tid, lp in entry.top],
        })
    return {"content": content}


def completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob],
                        text_offset_start: int) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset_start
    for entry in entries:
        text = _text(tokenizer, entry.token_id)
        tokens.append(text)
        token_logprobs.append(clamp_logprob(entry.logprob))
        top.append({_text(tokenizer, tid): clamp_logprob(lp) for tid, lp in entry.top} or None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}
