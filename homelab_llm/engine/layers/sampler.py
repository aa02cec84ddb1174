"""Sampler: logits -> next tokens (+ logprobs), per-request settings, batched where it pays.

Order, as vLLM and HF apply them: grammar masks (structured outputs); min_tokens masks stop tokens; repetition, presence and frequency
penalties; then `dispatch.sample` (a Triton kernel on the GPU, its reference on the CPU): greedy
rows take the argmax, the rest divide by temperature, keep top-k, top-p and min-p, and draw with
noise keyed by (request seed, output position), so a seed gives the same text in any batch.
Logprobs are those of the model's raw distribution, before any of the above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.outputs import TokenLogprob
from homelab_llm.engine.sequence import Sequence
from homelab_llm.engine.step_plan import HostStager
from homelab_llm.engine.structured.matcher import mask_words


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


def _apply_grammars(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Constrained rows: tokens the grammar forbids get -inf. The masks are filled on the host
    (llguidance, without the GIL) while the forward that produced `logits` may still run on the
    device; free rows are untouched."""
    rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return
    # As wide as the logits (a padded LM head) or the tokenizer, whichever is wider.
    words = max([mask_words(logits.shape[-1])] + [seqs[row].grammar.words for row in rows])
    mask = torch.empty((len(rows), words), dtype=torch.int32)
    for i, row in enumerate(rows):
        seqs[row].grammar.fill(mask, i)
    dispatch.apply_token_bitmask(logits, mask, torch.tensor(rows, dtype=torch.long))


def _top_logprobs(logprobs_row: torch.Tensor, token: int, n: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if n > 0:
        vals, ids = torch.topk(logprobs_row, n)
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(token_id=token, logprob=float(logprobs_row[token]), top=top)


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = eos_token_ids
        self._stagers: dict[torch.device, HostStager] = {}

    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The sampled token ids as a device tensor, without waiting for them."""
        assert logits.shape[0] == len(seqs)
        logits = logits.float().clone()
        _apply_grammars(logits, seqs)
        _mask_stops_before_min_tokens(logits, seqs, self.eos_token_ids)
        _apply_penalties(logits, seqs)
        dev = logits.device
        params = [s.params for s in seqs]
        stager = self._stagers.get(dev)
        if stager is None:
            stager = self._stagers[dev] = HostStager(dev)
        # Two pinned uploads instead of one pageable copy per parameter: a pageable copy would
        # make the host wait here for the forward still running on the device.
        floats = stager.upload(torch.tensor(
            [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
            dtype=torch.float32))
        ints = stager.upload(torch.tensor(
            [[p.top_k for p in params], [s.seed for s in seqs], [s.num_output_tokens for s in seqs]],
            dtype=torch.int64))
        modes = None
        if logits.is_cuda:  # which search passes the batch needs, from the host's own lists
            from homelab_llm.engine.kernels.sampling import SampleModes

            modes = SampleModes.of([p.temperature for p in params], [p.top_k for p in params],
                                   [p.top_p for p in params], logits.shape[-1])
        return dispatch.sample(
            logits, floats[0], ints[0].to(torch.int32), floats[1], floats[2], ints[1], ints[2], modes)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if want_logprobs else None
        tokens = self.sample_on_device(logits, seqs).tolist()  # waits: the caller needs the tokens

        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            for row, seq in enumerate(seqs):
                if seq.params.logprobs is not None:
                    logprobs[row] = _top_logprobs(raw_logprobs[row], tokens[row], seq.params.logprobs)
        return SampleResult(tokens, logprobs)
