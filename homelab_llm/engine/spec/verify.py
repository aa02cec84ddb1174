"""Verification: one forward scores K+1 positions of a drafted sequence; keep the longest prefix of
drafts the target model itself would have produced, plus the token after it.

Acceptance. Row j of a drafted sequence (j = 0..K) holds the target distribution p_j after the
sequence's tokens and drafts d_0..d_{j-1}. Each row is sampled exactly as a plain decode step would
sample that output position: the same sampler, the same per-request seed, the same position key
(`DraftRow` presents row j as the sequence with j more output tokens). Drafts are accepted while
x_j == d_j; the first x_j != d_j (or x_K when all K pass) is the correction/bonus token.

Why this keeps the output distribution. Both proposers draft deterministically (n-gram lookup, MTP
argmax), so the proposal q_j is a point mass on d_j. Standard speculative rejection sampling then
reads: accept d_j with probability min(1, p_j(d_j)/q_j(d_j)) = p_j(d_j); on rejection draw from the
residual max(0, p_j - q_j) renormalised = p_j with d_j removed. Drawing x_j ~ p_j and accepting iff
x_j == d_j is that same rule (P(accept) = p_j(d_j); given rejection x_j ~ p_j restricted to
tokens != d_j). Because x_j is the very draw a non-speculative run makes at that position, the
output is identical token for token to the run without speculation, for greedy and seeded sampling
alike, and a seed reproduces. `residual_sample` spells out the explicit form for the tests.
Constrained rows: p_j is the target distribution masked by the grammar after d_0..d_{j-1}, which
is exactly the mask a plain decode applies at that position once those drafts are its outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.sequence import Sequence
from homelab_llm.engine.structured.matcher import GrammarView


@dataclass(eq=False)
class DraftRow:
    """Sequence `seq` as it would stand after `offset` drafted tokens: what the sampler reads
    (params, seed, output count for the position key and min_tokens, tokens for penalties)."""
    seq: Sequence
    drafts: list[int]
    offset: int

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def seed(self) -> int:
        return self.seq.seed

    @property
    def grammar(self) -> GrammarView | None:
        """The grammar after this row's drafts: the mask at position j depends on drafts 0..j-1
        (the drafter checked them against the grammar, so the matcher can take them). The view
        consumes them, fills the mask and rolls them back; the sequence's own state only ever
        advances by the tokens the verify step emits."""
        state = self.seq.grammar
        return None if state is None else state.after(tuple(self.drafts[:self.offset]))

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + self.offset

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts[:self.offset]

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.drafts[:self.offset]


def sampler_rows(seqs: list[Sequence], drafts: list[list[int]]) -> list[DraftRow]:
    """One row per logits row of a verify step: len(drafts[i]) + 1 rows for sequence i."""
    return [DraftRow(seq, d, j) for seq, d in zip(seqs, drafts) for j in range(len(d) + 1)]


def accept(sampled: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Per sequence, the tokens to emit: the accepted drafts and the token after them.
    `sampled` holds the sampler's draw for every row, in sampler_rows order."""
    out: list[list[int]] = []
    row = 0
    for d in drafts:
        rows = sampled[row:row + len(d) + 1]
        n = 0
        while n < len(d) and rows[n] == d[n]:
            n += 1
        out.append(rows[:n + 1])
        row += len(d) + 1
    return out


def residual_sample(probs: torch.Tensor, draft: int, generator: torch.Generator) -> int:
    """Textbook rejection sampling of one row for a point-mass proposal on `draft`: accept it with
    probability p(draft), else draw from p with `draft` removed. Same law as `accept` applies."""
    if float(torch.rand((), generator=generator)) < float(probs[draft]):
        return draft
    residual = probs.clone()
    residual[draft] = 0.0
    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
