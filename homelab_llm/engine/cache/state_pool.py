"""Gated DeltaNet state memory (hybrid models): slots of conv + recurrent state, and who holds them.

StatePool (one per rank, device memory) holds per GDN layer a conv state [S, W-1, C_rank] in the
model dtype and a recurrent state [S, Hv_rank, Dk, Dv] in config.state_dtype (fp32), sized from
cache/state_layout.StateLayout at startup next to the KV pages. S = running slots (max_num_seqs)
+ snapshot slots (the radix cache's bounded snapshot pool). With speculative decoding each layer
also holds the running slots' pending-row areas for K+1 rows (kernels/gdn_pending.py).

StateSlots (rank 0, host only) hands the slots out: a running slot per admitted sequence (its
state after its first num_computed_tokens tokens), and snapshot slots that the radix cache pins
at nodes. Running slots are [0, num_running), snapshots [num_running, S): the two never compete.

State moves between slots only by copies that travel in the step plan (cache/copies.py), so
every rank applies the same copies, in order, right before the forward that depends on them.
"""

from __future__ import annotations

from collections import deque
import torch

from homelab_llm.engine.cache.state_layout import StateLayout
from homelab_llm.engine.kernels.gdn_pending import PendingRows, replay_slot, split_word
from homelab_llm.errors import HomelabError


class OutOfStateSlotsError(HomelabError):
    """More sequences running than the state pool was sized for (a scheduler bug)."""


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class StatePool:
    def __init__(self, layout: StateLayout, num_slots: int, device: torch.device,
                 conv_dtype: torch.dtype, pending_rows: int = 0, num_running: int = 0) -> None:
        self.layout = layout
        self.num_slots = num_slots
        self.device = device
        conv_shape = (num_slots, *layout.conv_shape)
        ssm_shape = (num_slots, *layout.recurrent_shape)
        ssm_dtype = torch_dtype(layout.recurrent_dtype)
        self.conv_states = [torch.zeros(conv_shape, dtype=conv_dtype, device=device)
                            for _ in range(layout.num_layers)]
        self.ssm_states = [torch.zeros(ssm_shape, dtype=ssm_dtype, device=device)
                           for _ in range(layout.num_layers)]
        hv, dk, dv = layout.recurrent_shape
        self.pending = [PendingRows.allocate(num_running, pending_rows, layout.key_heads_per_rank, dk, hv, dv,
                                             layout.conv_shape[1], conv_dtype, device)
                        for _ in range(layout.num_layers if pending_rows else 0)]

    @property
    def memory_bytes(self) -> int:
        areas = [t for p in self.pending for t in (p.d, p.k, p.u, p.x)]
        return sum(t.numel() * t.element_size() for t in self.conv_states + self.ssm_states + areas)

    def copy(self, src: list[int], dst: list[int]) -> None:
        """State of slot src[i] -> slot dst[i] in every layer, pair by pair in order (a later
        pair may read what an earlier one wrote). src entries are state words: a running slot's
        pending rows are applied to the copy (the source keeps them), so it is idempotent."""
        for word, d in zip(src, dst):
            slot, count, _ = split_word(word)
            if not count:
                for states in (self.conv_states, self.ssm_states):
                    for t in states:
                        t[d].copy_(t[slot])
                continue
            for conv, ssm, pend in zip(self.conv_states, self.ssm_states, self.pending):
                conv[d], ssm[d] = replay_slot(conv, ssm, pend, word)


class StateSlots:
    """Host-side bookkeeping of the pool's slots (rank 0's scheduler side)."""

    def __init__(self, num_running: int, num_snapshots: int) -> None:
        self.num_running, self.num_snapshots = num_running, num_snapshots
        self._running: deque[int] = deque(range(num_running))
        self._snapshots: deque[int] = deque(range(num_running, num_running + num_snapshots))

    @property
    def running_free(self) -> int:
        return len(self._running)

    @property
    def snapshots_held(self) -> int:
        return self.num_snapshots - len(self._snapshots)

    def alloc_running(self) -> int:
        if not self._running:
            raise OutOfStateSlotsError(f"all {self.num_running} running state slots are taken")
        return self._running.popleft()

    def free_running(self, slot: int) -> None:
        assert 0 <= slot < self.num_running and slot not in self._running, f"bad free of slot {slot}"
        self._running.append(slot)

    def alloc_snapshot(self) -> int | None:
        return self._snapshots.popleft() if self._snapshots else None

    def free_snapshot(self, slot: int) -> None:
        assert slot >= self.num_running and slot not in self._snapshots, f"bad free of snapshot {slot}"
        self._snapshots.append(slot)
