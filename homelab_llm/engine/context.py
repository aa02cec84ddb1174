"""The one explicit forward context: batch metadata set before a forward, cleared after.

Attention layers read it instead of having positions and page tables threaded through every call.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class ForwardContext:
    # All tensors live on the model's device. T = new tokens in the step, B = sequences.
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64, page * page_size + offset where its K/V are written
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32, KV length of each sequence after this step
    page_table: torch.Tensor  # [B, max_pages] int32, page ids (padding: 0)
    max_query_len: int
    max_seq_len: int
    page_size: int
    decode_only: bool  # every sequence has exactly one new token
    # Host copies, so the CPU path never syncs to learn lengths (None inside a CUDA graph).
    query_lens_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # Fixed split count for the decode kernel when replayed from a graph (lengths vary per replay).
    num_kv_splits: int | None = None
    # Hybrid models: each sequence's state slot (int32 [B], -1 = padding row) and whether it
    # resumes from the slot's state (bool [B]: num_computed_tokens > 0) or starts from zeros.
    state_indices: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    # Decode-form rows (speculative verify on hybrid models, engine/plan_rows.py): the first
    # `decode_rows` rows (all of them in a decode_only step) are one-token rows whose state_indices
    # entry is per row; the Gated DeltaNet layers chain them in groups of `verify_width` rows of
    # one sequence (K+1 in a verify step, else 1) and the rest of the step is varlen.
    verify_width: int = 1
    decode_rows: int = 0


_current: ForwardContext | None = None


def get_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context is set: call the model inside forward_context(...)")
    return _current


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous
