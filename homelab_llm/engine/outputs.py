"""What the engine hands back after each step, per request (the server streams these)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens produced since the last output of this request
    new_text: str  # text delta since the last output (never a split UTF-8 character)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0  # total so far
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token, if asked
    arrival_time: float = 0.0  # time.monotonic() values
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
