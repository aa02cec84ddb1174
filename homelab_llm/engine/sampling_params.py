"""SamplingParams: what a request asks of the sampler and the stop checks.

`validate(vocab_size)` is the admission check that keeps one request from hurting a batch: every
float finite and in range, every count and token id small enough for the int32/int64 tensors the
sampler packs them into, and (given the vocabulary) top_k and token ids inside it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from homelab_llm.errors import HomelabError

INT32_MAX = 2**31 - 1  # counts (max_tokens, min_tokens, top_k) travel in int32 tensors
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Stop checks run on the engine thread after every token of every sequence in the batch: these
# bound what one request can add to everyone's step time.
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS = 64, 1024, 1024


class SamplingParamsError(HomelabError, ValueError):
    """An out-of-range sampling value; the message names the field."""


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token only; N: plus top-N
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured output: an llguidance grammar (engine/structured/grammar.py `to_grammar`), and
    # whether it starts only after the reasoning section (`</think>`).
    grammar: str | None = None
    grammar_after_think: bool = False

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError naming the first bad field. With `vocab_size`, top_k and
        token ids are checked against the model's vocabulary too."""
        def bad(name: str, why: str) -> SamplingParamsError:
            return SamplingParamsError(f"{name} {why}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= INT32_MAX:
            raise bad("max_tokens", f"must be in [1, {INT32_MAX}], got {self.max_tokens}")
        if not 0 <= self.min_tokens <= INT32_MAX:
            raise bad("min_tokens", f"must be in [0, {INT32_MAX}], got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        top_k_max = INT32_MAX if vocab_size is None else vocab_size
        if not -1 <= self.top_k <= top_k_max:
            raise bad("top_k", f"must be -1 or 0 (off), or in [1, {top_k_max}] (the vocabulary "
                               f"size), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise bad("seed", f"must fit in a signed 64-bit integer, got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise bad("stop", f"strings must be at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"holds {len(self.stop_token_ids)} ids; at most "
                                        f"{MAX_STOP_TOKEN_IDS}")
        id_limit = INT32_MAX + 1 if vocab_size is None else vocab_size
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < id_limit:
                raise bad("stop_token_ids", f"holds {token_id}, outside the vocabulary "
                                            f"[0, {id_limit})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
