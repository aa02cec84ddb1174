"""Sampler: logits -> next tokens (+ logprobs), per-request settings, batched where it pays.

Order, as vLLM and HF apply them: min_tokens masks stop tokens; repetition, presence and frequency
penalties; greedy rows take the argmax; the rest divide by temperature, keep top-k, top-p and
min-p, and draw with the request's own generator (so a seed gives the same text in any batch).
Logprobs are those of the model's raw distribution, before any of the above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from homelab_llm.engine.outputs import TokenLogprob
from homelab_llm.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    for row, seq in enumerate(seqs):
        p = seq.params
        if not p.needs_penalties:
            continue
        device = logits.device
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=device)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                            vals * p.repetition_penalty)
        out = seq.output_token_ids
        if out and (p.presence_penalty or p.frequency_penalty):
            ids, counts = torch.tensor(out, dtype=torch.long, device=device).unique(return_counts=True)
            logits[row, ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty


def _mask_stops_before_min_tokens(logits: torch.Tensor, seqs: list[Sequence],
                                  eos_token_ids: tuple[int, ...]) -> None:
    for row, seq in enumerate(seqs):
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            if banned:
                logits[row, banned] = float("-inf")


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row: keep top-k, then the smallest top-p mass, then tokens >= min_p * max prob."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = cum - probs > top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def _top_logprobs(logprobs_row: torch.Tensor, token: int, n: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if n > 0:
        vals, ids = torch.topk(logprobs_row, n)
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(token_id=token, logprob=float(logprobs_row[token]), top=top)


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = eos_token_ids

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        assert logits.shape[0] == len(seqs)
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if want_logprobs else None
        logits = logits.float().clone()
        _mask_stops_before_min_tokens(logits, seqs, self.eos_token_ids)
        _apply_penalties(logits, seqs)

        tokens = logits.argmax(dim=-1).tolist()  # greedy rows are done here
        for row, seq in enumerate(seqs):
            p = seq.params
            if p.greedy:
                continue
            row_logits = _filter(logits[row] / p.temperature, p.top_k, p.top_p, p.min_p)
            probs = torch.softmax(row_logits, dim=-1)
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one draw per row.
            noise = torch.empty_like(probs).exponential_(generator=seq.generator)
            tokens[row] = int((probs / noise).argmax())

        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            for row, seq in enumerate(seqs):
                if seq.params.logprobs is not None:
                    logprobs[row] = _top_logprobs(raw_logprobs[row], tokens[row], seq.params.logprobs)
        return SampleResult(tokens, logprobs)
