"""MTP proposer: drafts from the checkpoint's multi-token prediction head (model/mtp.py).

Unlike n-gram lookup, an MTP draft needs the target model's hidden states, so drafts are made on
the device right after a step (spec/mtp_draft.py) and kept here until the next step's Drafter asks
for them. A stored draft is keyed by the sequence length it continues: a sequence whose tokens
moved on since (or that never got one) simply gets none and decodes plainly.

`enable_mtp` is the one place that decides whether `{"method": "mtp"}` can run on a model: the
family builds the head and the checkpoint declares it (mtp_num_hidden_layers >= 1).
Whether the tensors are really in the checkpoint is checked as the weights load (loader.py).
"""

from __future__ import annotations

import dataclasses

from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.spec.config import FLAG, SpeculativeConfig, SpeculativeConfigError

# Families whose model builds model/mtp.py's head from config.mtp_layers.
MTP_ARCHITECTURES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def enable_mtp(config: ModelConfig, spec: SpeculativeConfig | None) -> ModelConfig:
    """The model config to build: with use_mtp set when speculation is MTP (checked here, one
    line per error), unchanged otherwise."""
    if spec is None or spec.method != "mtp":
        return config
    if config.architecture not in MTP_ARCHITECTURES or config.mtp_num_hidden_layers < 1:
        raise SpeculativeConfigError(
            f'{FLAG} method "mtp" needs a checkpoint with MTP heads (mtp_num_hidden_layers >= 1 on '
            f"a {'/'.join(MTP_ARCHITECTURES)} model); {config.name or config.architecture} has none: "
            'use {"method": "ngram", ...}')
    return dataclasses.replace(config, use_mtp=True)


@dataclasses.dataclass
class _StoredDraft:
    num_tokens: int  # len(token_ids) the draft continues
    tokens: list[int]


class MtpProposer:
    """The Proposer (drafter.py) over drafts the MTP head made after the last step."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens
        self._drafts: dict[str, _StoredDraft] = {}

    def store(self, request_id: str, num_tokens: int, tokens: list[int]) -> None:
        self._drafts[request_id] = _StoredDraft(num_tokens, tokens)

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        stored = self._drafts.get(request_id)
        if stored is None or stored.num_tokens != len(token_ids):
            return []
        return stored.tokens[:min(k, self.k)]

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)
