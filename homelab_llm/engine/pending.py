"""Tokens sampled on the device whose values the host has not read yet (async scheduling).

With async scheduling the engine launches step k+1 before it reads step k's tokens: each sampling
sequence gets a placeholder as its last token, the next step's plan carries the placeholder, and
the step's input ids are patched on the device from the previous step's sampled tokens. The host
copy runs in the background (pinned memory, an event) and is read while step k+1 runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from homelab_llm.engine.sequence import Sequence
from homelab_llm.engine.step_plan import HostStager, StepBatch

PLACEHOLDER = -1  # a token id no vocabulary has


@dataclass
class PendingTokens:
    seqs: list[Sequence]
    device_tokens: torch.Tensor  # [len(seqs)] on the device
    host_tokens: torch.Tensor  # pinned, filled by a non-blocking copy
    ready: torch.cuda.Event | None  # None on the CPU, where the tokens already are on the host

    @classmethod
    def launch(cls, seqs: list[Sequence], device_tokens: torch.Tensor) -> "PendingTokens":
        if device_tokens.device.type == "cpu":
            host, ready = device_tokens, None
        else:
            host = torch.empty(device_tokens.shape, dtype=device_tokens.dtype, pin_memory=True)
            host.copy_(device_tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        for seq in seqs:
            seq.token_ids.append(PLACEHOLDER)
        return cls(seqs, device_tokens, host, ready)

    def read(self) -> list[int]:
        """The tokens, in `seqs` order; each sequence's placeholder is removed (the caller
        appends the real token through the output processor)."""
        if self.ready is not None:
            self.ready.synchronize()
        for seq in self.seqs:
            if seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
                seq.token_ids.pop()
        return self.host_tokens.tolist()


def placeholder_rows(scheduled, pending: PendingTokens) -> tuple[list[int], list[int]]:
    """For each scheduled sequence whose input is a placeholder: (row in this step's input ids,
    row in the pending tokens)."""
    where = {id(seq): i for i, seq in enumerate(pending.seqs)}
    plan_rows: list[int] = []
    pending_rows: list[int] = []
    row = 0
    for item in scheduled:
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        if start + n - len(item.spec) == seq.num_tokens and seq.token_ids[-1] == PLACEHOLDER:
            plan_rows.append(row + n - 1)
            pending_rows.append(where[id(seq)])
        row += n
    return plan_rows, pending_rows


def patch_input_ids(batch: StepBatch, plan_rows: list[int], pending_rows: list[int],
                    tokens: torch.Tensor, stager: HostStager) -> None:
    """batch.input_ids[plan_rows] = tokens[pending_rows], on the device. The index goes up from
    pinned memory: a pageable copy would make the host wait for the step still running."""
    index = stager.upload(torch.tensor([plan_rows, pending_rows], dtype=torch.long))
    batch.input_ids[index[0]] = tokens[index[1]].to(batch.input_ids.dtype)
