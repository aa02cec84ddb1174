"""Pending rows: how a speculative verify step leaves a Gated DeltaNet state without a slot per row.

A verify step decodes groups of R = K+1 rows of one sequence, and only after sampling does the
host know how many of them the sequence keeps. Instead of storing the state after every row
(R full states, each in a slot of its own), the kernels keep a sequence's running slot as

    base state + the first p rows of its last verify step, still to be applied ("pending"),

where row j is stored as its rank-1 update: the decay d_j, the L2-normalized key k_j and the
delta u_j = beta_j (v_j - (d_j S)^T k_j), so that S_j = d_j S_{j-1} + k_j u_j^T (an elementwise
replay, no sums), and for the conv its input x_j. The next decode or verify kernel of that
sequence loads the base, replays its p rows, and goes on: every step reads and writes one
state whatever K is, and rollback is the host setting p (accepted drafts + 1). No spare slots.

The areas, per GDN layer, for running slots only (PendingRows):
  d [S_run, 2, R, Hv] and k [S_run, 2, R, Hk, Dk] fp32: every program of a head (of a key head)
     reads them, so a step reads one half and writes the other;
  u [S_run, R, Hv, Dv] fp32 and x [S_run, R, C] (conv dtype): each program reads and writes only
     its own columns, so one copy, read before it is overwritten.

A decode row's int32 state word carries the slot and, for the group's first row, the pending
count and the half to read (state_word). In a group of R > 1 rows the kernel stores the replayed
state as the new base and this step's rows as the new pending rows (in half 1 - half); with
R = 1 it stores the state after the row: nothing stays pending. A copy out of a running slot
(a prefix snapshot: cache/state_pool.StatePool.copy) applies them (replay_slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PEND_SHIFT = 24  # slot in bits 0-23
PEND_MASK = 31  # pending count in bits 24-28
HALF_SHIFT = 29  # the d/k half to read in bit 29
SLOT_MASK = (1 << PEND_SHIFT) - 1
MAX_PENDING = PEND_MASK


def state_word(slot: int, pending: int = 0, half: int = 0) -> int:
    """A decode row's state_indices entry: slot, pending rows, read half (slot -1: padding)."""
    if slot < 0:
        return -1
    if slot > SLOT_MASK or not 0 <= pending <= MAX_PENDING or half not in (0, 1):
        raise ValueError(f"state word out of range: slot {slot}, pending {pending}, half {half}")
    return slot | pending << PEND_SHIFT | half << HALF_SHIFT


def split_word(word):
    """(slot, pending rows, read half) of a non-negative state word: an int, or an integer tensor
    of words (then three tensors)."""
    return word & SLOT_MASK, (word >> PEND_SHIFT) & PEND_MASK, (word >> HALF_SHIFT) & 1


@dataclass
class PendingRows:
    """One GDN layer's pending-row areas over the running slots (see the module docstring)."""

    d: torch.Tensor  # [S_run, 2, R, Hv] fp32
    k: torch.Tensor  # [S_run, 2, R, Hk, Dk] fp32
    u: torch.Tensor  # [S_run, R, Hv, Dv] fp32
    x: torch.Tensor  # [S_run, R, C] in the conv state's dtype

    @property
    def rows(self) -> int:
        return self.u.shape[1]

    @classmethod
    def allocate(cls, num_running: int, rows: int, key_heads: int, dk: int, value_heads: int, dv: int,
                 channels: int, conv_dtype: torch.dtype, device: torch.device) -> PendingRows:
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.zeros(num_running, 2, rows, value_heads, **f32),
                   torch.zeros(num_running, 2, rows, key_heads, dk, **f32),
                   torch.zeros(num_running, rows, value_heads, dv, **f32),
                   torch.zeros(num_running, rows, channels, dtype=conv_dtype, device=device))

    def check(self, ssm_state: torch.Tensor | None = None, conv_state: torch.Tensor | None = None) -> None:
        """The areas fit the layer's states (ValueError naming the shapes otherwise)."""
        s, _, r, hv = self.d.shape
        ok = self.k.shape[:3] == (s, 2, r) and self.u.shape[:3] == (s, r, hv) and self.x.shape[:2] == (s, r)
        ok = ok and all(t.dtype == torch.float32 and t.is_contiguous() for t in (self.d, self.k, self.u))
        ok = ok and self.x.is_contiguous() and s >= 1 and r >= 1
        if ssm_state is not None:
            ok = ok and tuple(ssm_state.shape[1:]) == (hv, self.k.shape[4], self.u.shape[3])
            ok = ok and ssm_state.shape[1] % self.k.shape[3] == 0
        if conv_state is not None:
            ok = ok and conv_state.shape[2] == self.x.shape[2] and conv_state.dtype == self.x.dtype
        if not ok:
            raise ValueError(f"pending rows d {tuple(self.d.shape)}, k {tuple(self.k.shape)}, u "
                             f"{tuple(self.u.shape)}, x {tuple(self.x.shape)} do not fit the states "
                             f"{None if ssm_state is None else tuple(ssm_state.shape)}, "
                             f"{None if conv_state is None else tuple(conv_state.shape)}")


def check_groups(rows_per_seq: int, pending: PendingRows | None) -> None:
    """Groups of more than one row (a verify) keep their rows pending, within the areas' rows."""
    if rows_per_seq > 1 and pending is None:
        raise ValueError(f"a verify step (rows_per_seq={rows_per_seq}) needs the layer's pending rows")
    if pending is not None and rows_per_seq > pending.rows:
        raise ValueError(f"rows_per_seq={rows_per_seq} exceeds the {pending.rows} pending rows a slot holds")


def replay_rule(state: torch.Tensor, pending: PendingRows, slot: torch.Tensor, count: torch.Tensor,
                half: torch.Tensor, most: int | None = None) -> torch.Tensor:
    """States [n, Hv, Dk, Dv] fp32 after each slot's pending rows: slot, count, half [n] int64
    (a new tensor). most: the largest count, if the caller knows it (else a host read)."""
    group = state.shape[1] // pending.k.shape[3]
    if most is None:
        most = int(count.max()) if count.numel() else 0
    for j in range(most):
        d = pending.d[slot, half, j]
        k = pending.k[slot, half, j].repeat_interleave(group, dim=1)
        step = state * d[..., None, None] + k[..., None] * pending.u[slot, j][:, :, None, :]
        state = torch.where((count > j)[:, None, None, None], step, state)
    return state


def replay_conv(hist: torch.Tensor, pending: PendingRows, slot: int, count: int) -> torch.Tensor:
    """The W-1 conv inputs [W-1, C] after the slot's `count` pending rows (in hist's dtype)."""
    return torch.cat([hist, pending.x[slot, :count]])[count:]


def replay_slot(conv_state: torch.Tensor, ssm_state: torch.Tensor, pending: PendingRows, word: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv inputs [W-1, C], state [Hv, Dk, Dv]) of a running slot after its pending rows, in
    the states' dtypes (new tensors; the slot keeps its base and pending rows)."""
    slot, count, half = split_word(word)
    at = [torch.tensor([v], device=ssm_state.device) for v in (slot, count, half)]
    ssm = replay_rule(ssm_state[slot:slot + 1].float(), pending, *at, most=count)[0].to(ssm_state.dtype)
    return replay_conv(conv_state[slot], pending, slot, count), ssm
