"""One door to the Gated DeltaNet kernels (Qwen3.5/3.6 linear-attention layers). The model calls
only these; each runs the Triton kernel on a GPU and the torch reference (gdn_ref) on the CPU or
when HOMELAB_LLM_KERNELS=ref, like dispatch.py.

Contract (all tensors on one device; T tokens of a varlen batch of B sequences; S state slots):
- cu_seqlens int32 [B+1]; state_indices int32 [B], the state slot of each sequence. A NEGATIVE slot
  is a padding row (CUDA-graph padding): its outputs are zeros and no state is read or written.
- has_initial_state bool [B]: False starts the sequence from zero state (the slot's old contents
  are ignored, then overwritten).
- conv_state [S, W-1, C] holds the last W-1 conv inputs, oldest first, in the activation dtype;
  ssm_state [S, Hv, Dk, Dv] is fp32. Prefill writes the state after the sequence's last token;
  decode advances it by one token in place.
- q/k are L2-normalized inside the rule and q is scaled by `scale` (default Dk**-0.5). Each q/k
  head serves Hv/Hk consecutive value heads.
- The decode functions are CUDA-graph capturable: no host syncs, shapes fixed by B.

Speculative decoding (issue 17): a verify step decodes groups of R = K+1 consecutive rows of one
sequence (`rows_per_seq`) and needs the layer's pending-row areas (`pending`,
kernels/gdn_pending.py): the state the group started from stays in the slot, and the group's rows
are kept as rank-1 updates still to apply. A decode row's state word then carries the slot, how
many of those rows the sequence kept (set by the host after acceptance) and which half of the
areas to read; the next decode of that slot applies them as it loads. R = 1 is the plain decode.
Rows past a sequence's drafts carry word -1 (zeros out).
"""

from __future__ import annotations

import torch

from homelab_llm.engine.kernels import gdn_ref
from homelab_llm.engine.kernels.dispatch import use_triton
from homelab_llm.engine.kernels.gdn_pending import PendingRows


def _check_slots(state_indices: torch.Tensor, batch: int, rows_per_seq: int = 1) -> None:
    if state_indices.dtype != torch.int32 or tuple(state_indices.shape) != (batch,):
        raise ValueError(f"state_indices must be int32 [{batch}], got {state_indices.dtype} "
                         f"{tuple(state_indices.shape)}")
    if rows_per_seq < 1 or batch % rows_per_seq:
        raise ValueError(f"{batch} decode rows do not split into groups of rows_per_seq={rows_per_seq}")


def _check_varlen(cu_seqlens: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor) -> None:
    batch = state_indices.shape[0]
    _check_slots(state_indices, batch)
    if cu_seqlens.dtype != torch.int32 or tuple(cu_seqlens.shape) != (batch + 1,):
        raise ValueError(f"cu_seqlens must be int32 [B+1] = [{batch + 1}], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    if has_initial_state.dtype != torch.bool or tuple(has_initial_state.shape) != (batch,):
        raise ValueError(f"has_initial_state must be bool [{batch}]")


def _check_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                ssm_state: torch.Tensor) -> None:
    if q.shape != k.shape or q.dim() != 3 or v.dim() != 3 or q.shape[0] != v.shape[0]:
        raise ValueError(f"q, k must be [T, Hk, Dk] and v [T, Hv, Dv]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    hk, hv = q.shape[1], v.shape[1]
    if hv % hk:
        raise ValueError(f"{hv} value heads do not divide into {hk} key heads")
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise ValueError(f"g and beta must be [T, Hv] = {tuple(v.shape[:2])}")
    if ssm_state.dim() != 4 or tuple(ssm_state.shape[1:]) != (hv, q.shape[2], v.shape[2]):
        raise ValueError(f"ssm_state must be [S, {hv}, {q.shape[2]}, {v.shape[2]}], got {tuple(ssm_state.shape)}")
    if ssm_state.dtype != torch.float32:
        raise ValueError("ssm_state must be float32")


def _check_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> None:
    c, w = weight.shape
    if x.dim() != 2 or x.shape[1] != c:
        raise ValueError(f"x must be [T, {c}] for a conv weight [{c}, {w}], got {tuple(x.shape)}")
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (w - 1, c):
        raise ValueError(f"conv_state must be [S, {w - 1}, {c}], got {tuple(conv_state.shape)}")


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          cu_seqlens: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor,
                          has_initial_state: torch.Tensor) -> torch.Tensor:
    """y [T, C] = silu(causal depthwise conv over (history ++ x_seq)); conv_state[slot] <- the
    last W-1 inputs of (history ++ x_seq), so a sequence shorter than W-1 keeps older inputs."""
    _check_conv(x, weight, conv_state)
    _check_varlen(cu_seqlens, state_indices, has_initial_state)
    if use_triton(x):
        from homelab_llm.engine.kernels import gdn_conv

        return gdn_conv.conv1d_prefill(x, weight, bias, cu_seqlens, conv_state, state_indices, has_initial_state)
    return gdn_ref.causal_conv1d_prefill_ref(x, weight, bias, cu_seqlens, conv_state, state_indices,
                                             has_initial_state)


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, state_indices: torch.Tensor,
                         rows_per_seq: int = 1, pending: PendingRows | None = None) -> torch.Tensor:
    """Decode rows, x [N, C] -> y [N, C], in groups of rows_per_seq tokens of one sequence (one
    token per sequence by default); conv_state (and pending's x) updated in place (see the module
    docstring)."""
    _check_conv(x, weight, conv_state)
    _check_slots(state_indices, x.shape[0], rows_per_seq)
    if use_triton(x):
        from homelab_llm.engine.kernels import gdn_conv

        return gdn_conv.conv1d_decode(x, weight, bias, conv_state, state_indices, rows_per_seq, pending)
    return gdn_ref.causal_conv1d_decode_ref(x, weight, bias, conv_state, state_indices, rows_per_seq, pending)


def gated_delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, cu_seqlens: torch.Tensor, ssm_state: torch.Tensor,
                             state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                             scale: float | None = None) -> torch.Tensor:
    """o [T, Hv, Dv] in v's dtype; each sequence's final state is written to ssm_state[slot]."""
    _check_rule(q, k, v, g, beta, ssm_state)
    _check_varlen(cu_seqlens, state_indices, has_initial_state)
    if use_triton(q):
        from homelab_llm.engine.kernels import gdn_chunk

        return gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, ssm_state, state_indices,
                                                has_initial_state, scale)
    return gdn_ref.gated_delta_rule_prefill_ref(q, k, v, g, beta, cu_seqlens, ssm_state, state_indices,
                                                has_initial_state, scale)


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, ssm_state: torch.Tensor, state_indices: torch.Tensor,
                            scale: float | None = None, rows_per_seq: int = 1,
                            gating: tuple[torch.Tensor, torch.Tensor] | None = None,
                            gated_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                            pair_block: int = 0, pending: PendingRows | None = None,
                            mma_pairs: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode rows: q, k [N, Hk, Dk], v [N, Hv, Dv] -> o [N, Hv, Dv], in groups of rows_per_seq
    tokens of one sequence (one token per sequence by default); state in place. gating =
    (A_log, dt_bias): g and beta are the raw a and b, gated first (gdn_gating; on a GPU inside
    the decode kernel, one launch instead of two). gated_norm = (z [N, Hv, Dv], weight, eps):
    the result is gated_rms_norm(o, z, weight, eps) (on a GPU inside the decode kernel too).
    pair_block (with gated_norm): each row's Hv * Dv values in that pair order
    (kernels/pair_order.py), for the out projection's W4A16 few-row kernel
    (dispatch.w4a16_pairs_block). pending: the layer's pending rows (required for groups of 2+
    rows; see the module docstring). mma_pairs (with gated_norm): the normed rows written there
    as the W4A16 mma kernel's pairs (kernels/w4a16_mma.empty_pairs) for the out projection
    (dispatch.w4a16_rows_mma); the returned rows are then scratch on a GPU."""
    _check_rule(q, k, v, g, beta, ssm_state)
    _check_slots(state_indices, q.shape[0], rows_per_seq)
    if use_triton(q):
        from homelab_llm.engine.kernels import gdn_recurrent

        return gdn_recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state, state_indices, scale,
                                                        rows_per_seq, gating, gated_norm, pair_block, pending,
                                                        mma_pairs)
    if (pair_block or mma_pairs is not None) and gated_norm is None:
        raise ValueError("pair order is written by the gated norm: pass gated_norm with pair_block")
    if gating is not None:
        g, beta = gdn_ref.gdn_gating_ref(g, beta, *gating)
    o = gdn_ref.gated_delta_rule_decode_ref(q, k, v, g, beta, ssm_state, state_indices, scale, rows_per_seq,
                                            pending)
    if gated_norm is None:
        return o
    z, weight, eps = gated_norm
    o = gated_rms_norm(o.reshape(-1, o.shape[-1]), z.reshape(-1, z.shape[-1]), weight, eps)
    if mma_pairs is not None:  # (the interpreter's pairs' launch: the route is a GPU's)
        from homelab_llm.engine.kernels.w4a16_mma import prep_pairs

        xh, xg = mma_pairs
        prep_pairs(o.view(z.shape[0], -1), xh.shape[1] // xg.shape[-1], out=mma_pairs)
    from homelab_llm.engine.kernels.pair_order import rows_in_pair_order

    return rows_in_pair_order(o.view(z.shape), pair_block)


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv] -> (g fp32 = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) in b's dtype)."""
    if a.shape != b.shape or a.dim() != 2 or A_log.shape != (a.shape[1],) or dt_bias.shape != (a.shape[1],):
        raise ValueError(f"a, b must be [T, Hv] and A_log, dt_bias [Hv]; got {tuple(a.shape)}, {tuple(b.shape)}, "
                         f"{tuple(A_log.shape)}, {tuple(dt_bias.shape)}")
    if use_triton(a):
        from homelab_llm.engine.kernels import gdn_norm

        return gdn_norm.gdn_gating(a, b, A_log, dt_bias)
    return gdn_ref.gdn_gating_ref(a, b, A_log, dt_bias)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight * silu(z) per row, fp32 math, x's dtype out; x, z [N, D], weight [D]."""
    if x.shape != z.shape or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x and z must share a shape [N, D] with weight [D]; got {tuple(x.shape)}, "
                         f"{tuple(z.shape)}, {tuple(weight.shape)}")
    if use_triton(x):
        from homelab_llm.engine.kernels import gdn_norm

        return gdn_norm.gated_rms_norm(x, z, weight, eps)
    return gdn_ref.gated_rms_norm_ref(x, z, weight, eps)
