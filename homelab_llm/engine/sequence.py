"""Sequence: one request's state as it moves waiting -> running -> finished (or back on preemption)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from homelab_llm.engine.outputs import TokenLogprob
from homelab_llm.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # annotations only: a Sequence never needs the cache or tokenizer code loaded
    from homelab_llm.engine.cache.radix import RadixNode
    from homelab_llm.engine.structured.matcher import GrammarState
    from homelab_llm.engine.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    max_tokens: int  # resolved from params.max_tokens and the context limit
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    status: SequenceStatus = SequenceStatus.WAITING
    # KV: the pages holding tokens 0..num_computed_tokens-1 (token i in page i // page_size).
    page_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # All-sliding models: page_table[:released_pages] lie wholly below the window and went back
    # to the pool (their ids stay as placeholders the kernels never read).
    released_pages: int = 0
    # Mixed full/sliding models (cache/page_groups.py): the sliding group's page table, indexed
    # like page_table; its first sliding_released entries went back to that group's pool.
    sliding_table: list[int] = field(default_factory=list)
    sliding_released: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    cache_node: RadixNode | None = None  # radix node locked while this sequence relies on its path
    # Hybrid models: the running state slot (cache/state_pool.py) holding the Gated DeltaNet
    # state after token_ids[:num_computed_tokens]; -1 while it has none.
    state_slot: int = -1
    # Speculative decoding on hybrid models: how many rows of its last verify step the slot
    # still holds pending, and which half of the pending areas they are in
    # (kernels/gdn_pending.py, cache/verify_slots.py).
    gdn_pending: int = 0
    gdn_half: int = 0
    num_preemptions: int = 0
    admitted: bool = False  # its prefix lookup has been counted
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why a request that ended with finish_reason "error" failed
    first_token_time: float | None = None
    finish_time: float | None = None
    seed: int = 0  # keys this request's random draws (with the output position)
    # Speculative decoding: draft tokens proposed for the next step (never part of token_ids).
    spec_token_ids: list[int] = field(default_factory=list)
    # Output text bookkeeping (detokenizer lives in the engine core).
    detokenizer: IncrementalDetokenizer | None = None
    output_text: str = ""
    emitted_text_len: int = 0
    emitted_token_count: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    grammar: GrammarState | None = None  # structured output: what may come next

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token lacks KV: one new token this step."""
        return self.num_uncomputed_tokens == 1 and self.num_output_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
