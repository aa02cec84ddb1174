"""Gated DeltaNet token mixer (the linear-attention layers of Qwen3.5/3.6), tensor-parallel.

Per token: in-projections give q, k, v (the conv channels), z (the output gate), b and a; a causal
depthwise conv1d + SiLU runs over q|k|v; the gated delta rule (decay g = -exp(A_log) *
softplus(a + dt_bias), beta = sigmoid(b), q and k L2-normalised inside) updates each sequence's
recurrent state; a gated RMSNorm with z and the out-projection finish.

State: each sequence owns a slot (ForwardContext.state_indices) in this layer's conv state
[slots, W-1, C_rank] and recurrent state [slots, Hv_rank, Dk, Dv] (fp32), bound by the runner like
the KV cache. Chunked prefill resumes from the slot when has_initial_state says so. A speculative
verify step's decode rows (ForwardContext.decode_rows, in groups of verify_width) go through the
decode kernels, which keep the group's rows pending in the layer's `pending` areas until the
slot's next decode applies the ones the sequence kept (kernels/gdn_pending.py).

Tensor parallelism: key heads, value heads and the conv channels split with them: every part of
q|k|v|z and b|a is sharded by heads, so a rank's conv channels are [its q | its k | its v] and
out_proj is row-parallel over its value heads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from homelab_llm.engine.context import get_context
from homelab_llm.engine.kernels import gdn
from homelab_llm.engine.kernels.gdn_pending import PendingRows
from homelab_llm.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.parallel.state import tp_rank, tp_size
from homelab_llm.engine.sharding import even_shard


def head_split(config: ModelConfig, tp_size: int, rank: int) -> tuple[int, int]:
    """(key heads, value heads) one rank owns; an uneven split is an error naming the sizes."""
    _, hk = even_shard(config.linear_num_key_heads, tp_size, rank, "linear_num_key_heads")
    _, hv = even_shard(config.linear_num_value_heads, tp_size, rank, "linear_num_value_heads")
    return hk, hv


def sharded_param(parts: list[int], tail: tuple[int, ...] = (),
                  dtype: torch.dtype | None = None) -> nn.Parameter:
    """A per-head (or per-channel) parameter made of contiguous parts, each split evenly across
    ranks: A_log and dt_bias ([Hv]), and the conv weight ([C, W], parts q|k|v)."""
    tp, rank = tp_size(), tp_rank()
    local = sum(even_shard(p, tp, rank, "Gated DeltaNet heads")[1] for p in parts)
    param = nn.Parameter(torch.empty(local, *tail, dtype=dtype), requires_grad=False)

    def weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.numel() != sum(parts) * max(1, param[0].numel()):
            raise ValueError(f"shape {tuple(loaded.shape)} does not fit {sum(parts)} x {tail}")
        loaded = loaded.reshape(sum(parts), *tail)  # conv1d: [C, 1, W] -> [C, W]
        pieces, offset = [], 0
        for total in parts:
            first, size = even_shard(total, tp, rank, "Gated DeltaNet heads")
            pieces.append(loaded[offset + first:offset + first + size])
            offset += total
        param.data.copy_(torch.cat(pieces))

    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    return param


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        tp, rank = tp_size(), tp_rank()
        self.num_k_heads, self.num_v_heads = head_split(config, tp, rank)
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.eps = config.rms_norm_eps
        kd, vd, hv = config.linear_key_dim, config.linear_value_dim, config.linear_num_value_heads
        # Checkpoint in_proj_qkv is split into q, k, v parts as it loads (split_modules).
        self.in_proj_qkvz = MergedColumnParallelLinear(config.hidden_size, [kd, kd, vd, vd],
                                                       part_names=["q", "k", "v", "z"])
        self.in_proj_ba = MergedColumnParallelLinear(config.hidden_size, [hv, hv], part_names=["b", "a"])
        self.conv1d = nn.Module()  # holds .weight [C_rank, W], the checkpoint's name for it
        self.conv1d.weight = sharded_param([kd, kd, vd], (config.linear_conv_kernel_dim,))
        self.A_log = sharded_param([hv], dtype=torch.float32)
        self.dt_bias = sharded_param([hv], dtype=torch.float32)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.head_v_dim), requires_grad=False)
        self.out_proj = RowParallelLinear(vd, config.hidden_size)
        # Bound by the runner (cache/state_pool.py); plain attributes like Attention.k_cache.
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        self.pending: PendingRows | None = None  # with speculative decoding

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mix(self.in_proj_qkvz(hidden), self.in_proj_ba(hidden))

    def mix(self, qkvz: torch.Tensor, ba: torch.Tensor, out_proj: Any = None) -> Any:
        """Everything after the two input projections: conv, the delta rule, the gated norm,
        out_proj (the decoder may form qkvz with its norm inside the GEMV's prologue). out_proj:
        in out_proj's place (layers/norm_chain.NormAfter: out_proj with the next norm in its
        epilogue, returning that norm's Prenormed)."""
        proj = out_proj or self.out_proj
        ctx = get_context()
        if self.conv_state is None or self.ssm_state is None or ctx.state_indices is None:
            raise RuntimeError("Gated DeltaNet layer has no state slots bound (runner bug)")
        tokens = qkvz.shape[0]
        mixed, z = qkvz[:, :self.conv_dim], qkvz[:, self.conv_dim:]
        b, a = ba[:, :self.num_v_heads], ba[:, self.num_v_heads:]
        # Decode-form rows first (all of a decode_only step; a hybrid verify's groups of K+1 rows
        # in a mixed one), varlen sequences after them.
        d = tokens if ctx.decode_only else ctx.decode_rows
        # the conv kernels read rows by their stride: the projection's columns need no copy
        # (one launch a layer at 2+ rows)
        mixed = self._rows(ctx, d, gdn.causal_conv1d_decode, gdn.causal_conv1d_prefill, (mixed,),
                           (self.conv1d.weight, None), self.conv_state, self.pending)
        kd = self.key_dim
        q = mixed[:, :kd].reshape(tokens, self.num_k_heads, self.head_k_dim)
        k = mixed[:, kd:2 * kd].reshape(tokens, self.num_k_heads, self.head_k_dim)
        v = mixed[:, 2 * kd:].reshape(tokens, self.num_v_heads, self.head_v_dim)
        if d == tokens and tokens:
            # decode rows only: the decode kernel gates a and b and applies the gated norm itself
            # (in the out projection's pair order where its W4A16 kernel reads x so)
            # (or as the mma kernel's pairs where that kernel takes the rows: no pairs' launch)
            z_heads = z.view(tokens, self.num_v_heads, self.head_v_dim)
            mma = proj.rows_take_mma_pairs(tokens, v)
            pairs = 0 if mma else proj.rows_pairs_block(tokens, v)
            scratch = None
            if mma:
                from homelab_llm.engine.kernels.w4a16_mma import empty_pairs

                scratch = empty_pairs(tokens, self.value_dim, proj.w4.group_size, v.device)
            o = gdn.gated_delta_rule_decode(q, k, v, a, b, self.ssm_state, ctx.state_indices,
                                            rows_per_seq=ctx.verify_width, gating=(self.A_log, self.dt_bias),
                                            gated_norm=(z_heads, self.norm.weight, self.eps), pair_block=pairs,
                                            pending=self.pending, mma_pairs=scratch)
            if mma:
                return proj(o.reshape(tokens, self.value_dim), pairs=scratch)
            return proj(o.reshape(tokens, self.value_dim), paired=pairs > 0)
        g, beta = gdn.gdn_gating(a, b, self.A_log, self.dt_bias)  # strided rows: no copies
        o = self._rows(ctx, d, gdn.gated_delta_rule_decode, gdn.gated_delta_rule_prefill,
                       (q, k, v, g, beta), (), self.ssm_state, self.pending)
        o = gdn.gated_rms_norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim),
                               self.norm.weight, self.eps)
        return proj(o.reshape(tokens, self.value_dim))

    @staticmethod
    def _rows(ctx, d: int, decode, prefill, row_args: tuple[torch.Tensor, ...], const_args: tuple,
              state: torch.Tensor, pending: PendingRows | None) -> torch.Tensor:
        """decode(...) over the first d rows (a state slot per row, chained in groups of
        ctx.verify_width), prefill(...) over the varlen rest; one call when the step is all one
        or the other. Both kernels take (row tensors, constants, [cu_seqlens,] state, slots, ...)."""
        total = row_args[0].shape[0]
        out = []
        if d:
            out.append(decode(*(t[:d] for t in row_args), *const_args, state, ctx.state_indices[:d],
                              rows_per_seq=ctx.verify_width, pending=pending))
        if d < total or total == 0:
            qsl = ctx.query_start_loc[d:] - d if d else ctx.query_start_loc
            out.append(prefill(*(t[d:] for t in row_args), *const_args, qsl, state, ctx.state_indices[d:],
                               ctx.has_initial_state[d:]))
        return out[0] if len(out) == 1 else torch.cat(out)
