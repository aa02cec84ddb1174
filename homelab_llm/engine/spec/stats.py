"""Speculative decoding counters, with vLLM's meaning: a draft is one sequence's proposal in one
step; accepted tokens count drafts the target model confirmed (the bonus token is not counted)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1

    def as_dict(self) -> dict[str, float | int | list[int]]:
        """The /v1/status `spec_decode` section. mean_accepted_length counts the token every verify
        step yields anyway (1 + accepted per draft, vLLM's definition)."""
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        mean = 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        return {"drafts": self.num_drafts, "draft_tokens": self.num_draft_tokens,
                "accepted_tokens": self.num_accepted_tokens, "acceptance_rate": round(rate, 4),
                "mean_accepted_length": round(mean, 4),
                "accepted_per_position": list(self.accepted_per_position)}
