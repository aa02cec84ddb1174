"""Plain-torch references for the Gated DeltaNet (Qwen3.5/3.6 linear-attention) kernels; the CPU
engine path runs these, and every Triton kernel in gdn_*.py is tested against them.

Shapes (one layer; T tokens of a varlen batch of B sequences, S state slots):
  conv:  x [T, C], weight [C, W], conv_state [S, W-1, C] (oldest input first)
  rule:  q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], ssm_state [S, Hv, Dk, Dv] fp32
  cu_seqlens int32 [B+1]; state_indices int32 [B], a negative slot marks a padding row: its tokens
  get zeros and no state is read or written.

Math, per value head h (its q/k head is h // (Hv // Hk)), q and k L2-normalized (eps 1e-6 inside
the rsqrt, as fla and transformers do) and q scaled by Dk**-0.5:
  S <- S * exp(g_t);  u_t = beta_t * (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t
All math is fp32; outputs take v's dtype. The prefill reference is the chunked (WY / UT-transform)
form of the same recurrence, so it is fast enough for the CPU engine; `gated_delta_rule_steps_ref`
is the token-by-token form the tests hold both to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from homelab_llm.engine.kernels.gdn_pending import (
    PendingRows, check_groups, replay_conv, replay_rule, split_word,
)

L2_EPS = 1e-6
CHUNK = 64


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def seq_bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] per sequence (a host read: references only)."""
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


# ----------------------------------------------------------------------------------------------
# causal depthwise conv1d + SiLU

def _conv_silu(xx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n_out: int) -> torch.Tensor:
    """xx [L + W - 1, C] fp32 (history first) -> silu(conv) of the last n_out positions, [n_out, C]."""
    width = weight.shape[1]
    w = weight.float()
    out = torch.zeros((n_out, xx.shape[1]), dtype=torch.float32, device=xx.device)
    base = xx.shape[0] - n_out - (width - 1)
    for j in range(width):
        out += xx[base + j: base + j + n_out] * w[:, j]
    if bias is not None:
        out += bias.float()
    return F.silu(out)


def causal_conv1d_prefill_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              cu_seqlens: torch.Tensor, conv_state: torch.Tensor,
                              state_indices: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """y [T, C] in x's dtype; conv_state[slot] <- the last W-1 inputs of (history ++ x_seq)."""
    y = torch.zeros_like(x)
    slots, init = state_indices.tolist(), has_initial_state.tolist()
    for (s, e), slot, has_init in zip(seq_bounds(cu_seqlens), slots, init):
        if slot < 0:
            continue
        hist = conv_state[slot].float() if has_init else torch.zeros_like(conv_state[slot], dtype=torch.float32)
        xx = torch.cat([hist, x[s:e].float()])
        y[s:e] = _conv_silu(xx, weight, bias, e - s).to(x.dtype)
        conv_state[slot] = xx[xx.shape[0] - hist.shape[0]:].to(conv_state.dtype)
    return y


def group_starts(state_indices: torch.Tensor, rows_per_seq: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(live groups, their slots, pending counts, read halves), int64 [n], from each group's first
    state word (a plain slot is a word with nothing pending)."""
    words = state_indices.view(-1, rows_per_seq)[:, 0].long()
    live = (words >= 0).nonzero().flatten()
    return live, *split_word(words[live])


def causal_conv1d_decode_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_state: torch.Tensor, state_indices: torch.Tensor,
                             rows_per_seq: int = 1, pending: PendingRows | None = None) -> torch.Tensor:
    """Decode rows in groups of R = rows_per_seq consecutive tokens of one sequence (R = 1: a
    plain decode; R = K+1: a verify). A group's history is its slot's W-1 inputs after its
    pending rows (kernels/gdn_pending.py). R = 1: the slot keeps the last W-1 inputs after the
    row; R > 1: the slot keeps that history and the group's R inputs become its pending rows.
    y [B*R, C]; rows with a negative state word get zeros."""
    check_groups(rows_per_seq, pending)
    y = torch.zeros_like(x)
    words = state_indices.tolist()
    live, slots, counts, _ = group_starts(state_indices, rows_per_seq)
    for group, slot, count in zip(live.tolist(), slots.tolist(), counts.tolist()):
        first = group * rows_per_seq
        hist = replay_conv(conv_state[slot], pending, slot, count) if count else conv_state[slot]
        xx = torch.cat([hist.float(), x[first:first + rows_per_seq].float()])
        out = _conv_silu(xx, weight, bias, rows_per_seq).to(x.dtype)
        for j in range(rows_per_seq):
            if words[first + j] >= 0:
                y[first + j] = out[j]
        if rows_per_seq == 1:
            conv_state[slot] = xx[1:].to(conv_state.dtype)
        else:
            conv_state[slot] = hist
            pending.x[slot, :rows_per_seq] = x[first:first + rows_per_seq].to(pending.x.dtype)
    return y


# ----------------------------------------------------------------------------------------------
# gated delta rule

def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, Hk, Dk] -> [Hv, L, Dk] fp32: GQA-expanded (consecutive value heads share a key head),
    L2-normalized, q scaled."""
    dk = q.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    group = num_v_heads // q.shape[1]
    qf = l2_normalize(q.float()).repeat_interleave(group, dim=1) * scale
    kf = l2_normalize(k.float()).repeat_interleave(group, dim=1)
    return qf.transpose(0, 1), kf.transpose(0, 1)


def chunked_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, prepared inputs: q, k [H, L, Dk], v [H, L, Dv], g, beta [H, L], state
    [H, Dk, Dv], all fp32. Returns (o [H, L, Dv], final state).

    Within a chunk with cumulative log-decay c_i (c_i = g_1 + ... + g_i) and start state S0:
      u = (I + L)^-1 (beta * (v - e^c * (k S0))),  L_ij = beta_i (k_i . k_j) e^(c_i - c_j), j < i
      o_i = e^(c_i) q_i S0 + sum_{j <= i} e^(c_i - c_j) (q_i . k_j) u_j
      S_end = e^(c_n) S0 + sum_j e^(c_n - c_j) k_j u_j^T
    which is the recurrence unrolled (u_j is the delta each token writes).
    """
    length = q.shape[1]
    out = torch.empty_like(v)
    for s in range(0, length, chunk):
        e = min(s + chunk, length)
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e]
        c = g[:, s:e].cumsum(-1)
        n = e - s
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower, (c[:, :, None] - c[:, None, :]).clamp_max(0).exp(), 0.0)
        a = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay).tril(-1)
        a = a + torch.eye(n, dtype=a.dtype, device=a.device)
        rhs = bc[:, :, None] * (vc - c.exp()[:, :, None] * (kc @ state))
        u = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        out[:, s:e] = c.exp()[:, :, None] * (qc @ state) + ((qc @ kc.transpose(1, 2)) * decay) @ u
        tail = (c[:, -1:] - c).exp()[:, :, None]
        state = c[:, -1].exp()[:, None, None] * state + (kc * tail).transpose(1, 2) @ u
    return out, state


def gated_delta_rule_prefill_ref(q, k, v, g, beta, cu_seqlens, ssm_state, state_indices, has_initial_state,
                                 scale: float | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """o [T, Hv, Dv] in v's dtype; the final state of each sequence is written to ssm_state[slot]."""
    hv, dk, dv = v.shape[1], q.shape[-1], v.shape[-1]
    out = torch.zeros_like(v)
    slots, init = state_indices.tolist(), has_initial_state.tolist()
    for (s, e), slot, has_init in zip(seq_bounds(cu_seqlens), slots, init):
        if slot < 0:
            continue
        qf, kf = prepare_qk(q[s:e], k[s:e], hv, scale)
        state = (ssm_state[slot].float() if has_init
                 else torch.zeros((hv, dk, dv), dtype=torch.float32, device=v.device))
        o, state = chunked_rule(qf, kf, v[s:e].float().transpose(0, 1), g[s:e].float().t(),
                                beta[s:e].float().t(), state, chunk)
        out[s:e] = o.transpose(0, 1).to(v.dtype)
        ssm_state[slot] = state.to(ssm_state.dtype)
    return out


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch of heads: q, k [..., Dk], v [..., Dv], g, beta [...], state [..., Dk, Dv]
    (prepared, fp32). Returns (o [..., Dv], new state)."""
    state = state * g.exp()[..., None, None]
    u = beta[..., None] * (v - (state * k[..., None]).sum(-2))
    state = state + k[..., None] * u[..., None, :]
    return (state * q[..., None]).sum(-2), state


def gated_delta_rule_decode_ref(q, k, v, g, beta, ssm_state, state_indices, scale: float | None = None,
                                rows_per_seq: int = 1, pending: PendingRows | None = None) -> torch.Tensor:
    """Decode rows in groups of R = rows_per_seq tokens of one sequence (R = 1: one token per
    sequence; R = K+1: a verify). A group starts from its slot's state after its pending rows
    (kernels/gdn_pending.py). R = 1: the slot keeps the state after the row; R > 1: the slot
    keeps the start state and the group's R rows become its pending rows (d and k in the half
    the word does not read). Rows with a negative state word output zeros. o [B*R, Hv, Dv]."""
    check_groups(rows_per_seq, pending)
    out = torch.zeros_like(v)
    live, slot, count, half = group_starts(state_indices, rows_per_seq)
    if live.numel() == 0:
        return out
    state = ssm_state[slot].float()
    if pending is not None:
        state = replay_rule(state, pending, slot, count, half)
        if rows_per_seq > 1:
            ssm_state[slot] = state.to(ssm_state.dtype)
    words = state_indices.view(-1, rows_per_seq)[live]
    for j in range(rows_per_seq):
        rows = live * rows_per_seq + j
        qf, kf = (t.transpose(0, 1) for t in prepare_qk(q[rows], k[rows], v.shape[1], scale))  # [n, Hv, Dk]
        decay = g[rows].float().exp()
        state = state * decay[..., None, None]
        u = beta[rows].float()[..., None] * (v[rows].float() - (state * kf[..., None]).sum(-2))
        state = state + kf[..., None] * u[..., None, :]
        keep = words[:, j] >= 0
        out[rows[keep]] = (state * qf[..., None]).sum(-2)[keep].to(v.dtype)
        if rows_per_seq > 1:
            pending.d[slot, 1 - half, j] = decay
            pending.k[slot, 1 - half, j] = l2_normalize(k[rows].float())
            pending.u[slot, j] = u
    if rows_per_seq == 1:
        ssm_state[slot] = state.to(ssm_state.dtype)
    return out


def gated_delta_rule_steps_ref(q, k, v, g, beta, cu_seqlens, ssm_state, state_indices, has_initial_state,
                               scale: float | None = None) -> torch.Tensor:
    """Token-by-token prefill (slow, the definition): same contract as gated_delta_rule_prefill_ref."""
    hv, dk, dv = v.shape[1], q.shape[-1], v.shape[-1]
    out = torch.zeros_like(v)
    for (s, e), slot, has_init in zip(seq_bounds(cu_seqlens), state_indices.tolist(), has_initial_state.tolist()):
        if slot < 0:
            continue
        qf, kf = prepare_qk(q[s:e], k[s:e], hv, scale)
        state = (ssm_state[slot].float() if has_init
                 else torch.zeros((hv, dk, dv), dtype=torch.float32, device=v.device))
        for t in range(e - s):
            o, state = recurrent_step(qf[:, t], kf[:, t], v[s + t].float(), g[s + t].float(), beta[s + t].float(),
                                      state)
            out[s + t] = o.to(v.dtype)
        ssm_state[slot] = state.to(ssm_state.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# gating and the gated RMSNorm around the rule

def gdn_gating_ref(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g fp32 = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) in b's dtype), [T, Hv]."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float()).to(b.dtype)


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight * silu(z), fp32 math, x's dtype out; x, z [N, D], weight [D] (plain w,
    not 1 + w: Qwen3.5's RMSNormGated initializes it to ones)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * F.silu(z.float())).to(x.dtype)
