"""Random inputs for the Gated DeltaNet tests (test_gdn_*.py), shaped like the kernels' contract
(kernels/gdn.py): varlen token rows, a state-slot pool with spare slots, a shuffled slot map."""

from __future__ import annotations

import torch

# Qwen3.6-27B's linear-attention shape: 16 key heads, 48 value heads of 128, conv over q, k and v.
FULL_RULE = dict(hk=16, hv=48, dk=128, dv=128)
FULL_CONV_CHANNELS = 2 * 16 * 128 + 48 * 128  # 10240


def cu_seqlens(lens: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def rule_inputs(lens: list[int], hk: int, hv: int, dk: int, dv: int, gen: torch.Generator,
                slots: list[int] | None = None, has_init: list[bool] | None = None,
                weak_decay: bool = False, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """(q, k, v, g, beta, cu_seqlens, ssm_state, state_indices, has_initial_state). Decays in the
    model's range (-exp(A_log) * softplus(.)): mostly -0.02..-2, or -0.001..-0.05 with weak_decay,
    where the state remembers hundreds of tokens (the harder case for rounding)."""
    t, n = sum(lens), len(lens)
    q = torch.randn(t, hk, dk, generator=gen)
    k = torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    lo, span = (0.001, 0.049) if weak_decay else (0.02, 2.0)
    g = -(torch.rand(t, hv, generator=gen) * span + lo)
    beta = torch.rand(t, hv, generator=gen)
    slots = slots if slots is not None else list(range(n))[::-1]
    init = has_init if has_init is not None else [i % 2 == 0 for i in range(n)]
    state = torch.randn(n + 2, hv, dk, dv, generator=gen) * 0.5
    return (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), g.to(device), beta.to(device, dtype),
            cu_seqlens(lens, device), state.to(device), torch.tensor(slots, dtype=torch.int32, device=device),
            torch.tensor(init, dtype=torch.bool, device=device))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max(1, max |want|): one number per tensor, scale-free for big outputs."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1.0)).item()


def scaled_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want| (no floor at 1): for outputs well below 1, such as Gated
    DeltaNet's (unit q over sqrt(dk)), where rel_err is an absolute bound."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def pending_inputs(num_slots: int, rows: int, hk: int, hv: int, dk: int, dv: int, channels: int,
                   gen: torch.Generator, conv_dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu"):
    """Random pending-row areas (kernels/gdn_pending.PendingRows) in the model's ranges: decays
    0.1-1, unit keys, deltas and conv inputs of the inputs' scale."""
    from homelab_llm.engine.kernels.gdn_pending import PendingRows

    k = torch.randn(num_slots, 2, rows, hk, dk, generator=gen)
    return PendingRows(
        (torch.rand(num_slots, 2, rows, hv, generator=gen) * 0.9 + 0.1).to(device),
        (k / k.norm(dim=-1, keepdim=True)).to(device),
        (torch.randn(num_slots, rows, hv, dv, generator=gen) * 0.5).to(device),
        torch.randn(num_slots, rows, channels, generator=gen).to(device, conv_dtype))


def pending_words(slots: list[int], rows_per_seq: int, max_pending: int, gen: torch.Generator) -> list[int]:
    """State words for decode rows in groups of rows_per_seq: each live group's first row gets a
    random pending count (0..max_pending) and half; other rows keep their liveness (-1 or >= 0)."""
    from homelab_llm.engine.kernels.gdn_pending import state_word

    words = list(slots)
    for first in range(0, len(words), rows_per_seq):
        if words[first] >= 0:
            count = int(torch.randint(0, max_pending + 1, (1,), generator=gen))
            words[first] = state_word(words[first], count, int(torch.randint(0, 2, (1,), generator=gen)))
    return words
