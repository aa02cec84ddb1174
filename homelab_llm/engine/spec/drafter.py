"""Drafter: before each step, give every sequence past its prompt the drafts it may verify this step.

The proposer (n-gram or MTP) guesses; the drafter bounds the guess so that verification can never
overshoot the request: at most max_tokens - (outputs so far) - 1 drafts (the verify step emits up
to K+1 tokens) and never past the context limit. A constrained sequence's draft is cut at the
first token its grammar refuses (GrammarState.check_draft), so every drafted row has a mask: the
verify step masks row j with the grammar after the first j drafts (spec/verify.py). A sequence that
cannot take a draft simply runs a plain decode (one row), so near its end a request falls back by
itself.
"""

from __future__ import annotations

from typing import Protocol

from homelab_llm.engine.sequence import Sequence
from homelab_llm.engine.spec.config import SpeculativeConfig
from homelab_llm.engine.spec.mtp import MtpProposer
from homelab_llm.engine.spec.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]: ...

    def forget(self, request_id: str) -> None: ...


def room_for_drafts(seq: Sequence, k: int, max_model_len: int) -> int:
    return max(0, min(k, seq.max_tokens - seq.num_output_tokens - 1, max_model_len - seq.num_tokens - 1))


class Drafter:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len

    def draft(self, running: list[Sequence]) -> None:
        """Set seq.spec_token_ids for every running sequence ([] where none applies, and for all
        of them in a batch past the config's disable_by_batch_size)."""
        k = self.config.num_speculative_tokens if self.config.drafts_in_batch(len(running)) else 0
        for seq in running:
            # Decodes, and outputs being recomputed (after a hybrid rollback or a preemption):
            # drafts follow the last token either way.
            room = room_for_drafts(seq, k, self.max_model_len) if seq.num_output_tokens > 0 else 0
            draft = self.proposer.propose(seq.request_id, seq.token_ids, room) if room else []
            if draft and seq.grammar is not None:
                draft = draft[:seq.grammar.check_draft(draft)]
            seq.spec_token_ids = draft

    def forget(self, seq: Sequence) -> None:
        seq.spec_token_ids = []
        self.proposer.forget(seq.request_id)


def make_drafter(config: SpeculativeConfig, max_model_len: int) -> Drafter:
    """n-gram lookup, or the store MTP drafts land in (spec/mtp_draft.py fills it)."""
    proposer: Proposer
    if config.method == "mtp":
        proposer = MtpProposer(config.num_speculative_tokens)
    else:
        proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max,
                                 config.prompt_lookup_min)
    return Drafter(config, proposer, max_model_len)
