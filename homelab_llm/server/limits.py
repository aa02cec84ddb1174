"""Cheap bounds a request must pass before the expensive work (validating, templating,
tokenizing, submitting) starts, so one absurd request cannot occupy the server.

`check_body_shape` runs on the decoded JSON before pydantic: validating half a million messages
holds the GIL for seconds (no thread helps), while counting them is free, and no request with more
messages than the context has tokens, or more prompts than a request may run, can succeed.

The prompt bound needs no tokenizer run: a token stands for at most `max_token_bytes` bytes of
text (the longest entry of the vocabulary), and a character is at least one byte, so a text of C
characters has at least C / max_token_bytes tokens. A text longer than
max_model_len * max_token_bytes * SAFETY characters cannot fit the context whatever it says;
SAFETY covers normalizers that shrink text (e.g. NFKC folding) before it is split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from homelab_llm.server.errors import bad_request

SAFETY = 2


def max_token_bytes(tokenizer: Any) -> int:
    """Bytes of the vocabulary's longest token (~0.1 s for 150K tokens: run it off the loop)."""
    return max(1, max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size)))


@dataclass(frozen=True)
class PromptBound:
    """The character count beyond which no text fits the context (see the module docstring)."""

    max_chars: int
    max_model_len: int

    @classmethod
    def of(cls, tokenizer: Any, max_model_len: int) -> "PromptBound":
        return cls(max_model_len * max_token_bytes(tokenizer) * SAFETY, max_model_len)

    def check(self, num_chars: int, param: str) -> None:
        """A 400 for a text that cannot fit the context, decided from its length alone."""
        if num_chars > self.max_chars:
            raise bad_request(f"{param} has {num_chars} characters; no text longer than "
                              f"{self.max_chars} characters fits the model's context limit of "
                              f"{self.max_model_len} tokens", param, "context_length_exceeded")


def message_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the text the client sent in chat messages (the template only adds)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
    return total


def check_num_seqs(num_prompts: int, n: int, limit: int) -> None:
    total = num_prompts * n
    if total > limit:
        raise bad_request(f"this request asks for {num_prompts} prompt(s) x n={n} = {total} "
                          f"sequences, more than this server's limit of {limit} per request "
                          f"(--max-seqs-per-request)", "n" if num_prompts == 1 else "prompt")


def check_body_shape(body: Any, max_model_len: int, max_seqs: int) -> None:
    """Counts no valid request can have, checked on the raw decoded body (see the docstring)."""
    if not isinstance(body, dict):
        return  # parse_body says what is wrong
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > max_model_len:
        raise bad_request(f"messages has {len(messages)} entries; each takes at least one token "
                          f"and the context limit is {max_model_len} tokens", "messages",
                          "context_length_exceeded")
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return
    if isinstance(prompt[0], int):  # one prompt of token ids
        token_lists = [prompt]
    else:  # a batch: strings or token-id lists
        check_num_seqs(len(prompt), 1, max_seqs)
        token_lists = [p for p in prompt if isinstance(p, list)]
    for ids in token_lists:
        if len(ids) > max_model_len:
            raise bad_request(f"a prompt of {len(ids)} token ids exceeds the context limit of "
                              f"{max_model_len} tokens", "prompt", "context_length_exceeded")
