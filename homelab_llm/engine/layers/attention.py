"""Paged attention over one layer's KV cache.

The runner allocates the cache and binds `k_cache`/`v_cache` (and for int8 `k_scale`/`v_scale`)
on each of these modules. A forward stores the step's new K/V at ctx.slot_mapping, then attends
each sequence's new queries over its whole page list (cached prefix + new tokens).

Given the rope tables, q and k arrive unrotated and the rotation happens here: on a GPU in the same
kernel that writes K/V into the cache (kv_store.rope_store_kv), one launch per layer instead of two,
or, on decode steps where the arch's decode tiles say so, inside the decode attention kernel
itself (dispatch.paged_attention's new_kv).
"""

from __future__ import annotations

import torch
from torch import nn

from homelab_llm.engine.context import get_context
from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.kernels.ref import attend_ref
from homelab_llm.engine.layers.rotary import RopeTables, apply_rotary


class Attention(nn.Module):
    """window > 0: a sliding-window layer (each query sees its last `window` keys). `sinks`
    (gpt-oss) is set by the model: [num_heads] float32 per-head sink logits."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 window: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.window = scale, window
        self.sinks: torch.Tensor | None = None
        # Bound by the runner; plain attributes (not buffers) so state_dict and .to() leave them be.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        # Set by the runner on a sliding layer whose cache is the sliding page group's: it then
        # reads the context's sliding slot mapping and page table.
        self.sliding_group = False

    def norms_in_store(self, q: torch.Tensor, rope: RopeTables | None) -> bool:
        """Whether forward takes QK-norm attention's per-head norms (qk_norms=) into the kernel
        that rotates q and k and stores K/V (a GPU, the rope tables, the cache bound): one
        launch fewer a layer than the separate q/k norm launch."""
        return (rope is not None and rope.in_kernel and self.k_cache is not None
                and self.v_cache is not None and dispatch.use_triton(q))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rope: RopeTables | None = None, gate: torch.Tensor | None = None,
                qk_norms: tuple[nn.Module, nn.Module] | None = None, pair_block: int = 0) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]. Without `rope`, q and k are already
        rotated; with it, they are rotated here (q in place on the kernel path). gate [T, Hq, D]
        (gated attention, may be strided): the output times sigmoid(gate), on a GPU's decode
        steps inside the attention's merge kernel. qk_norms (q_norm, k_norm), where
        norms_in_store says so: q and k (views of the projection) are normalized per head in
        the rotating store kernel, q into a new tensor. pair_block: each row in that pair order
        (kernels/pair_order.py; see project)."""
        ctx = get_context()
        sinks = self.sinks
        if sinks is not None and sinks.dtype != torch.float32:  # a model cast after loading
            sinks = sinks.float()
        has_cache = self.k_cache is not None and self.v_cache is not None
        slot_mapping, page_table = ctx.slot_mapping, ctx.page_table
        if self.sliding_group and has_cache:
            assert ctx.sliding_page_table is not None, "a sliding page group layer without its table"
            slot_mapping, page_table = ctx.sliding_slot_mapping, ctx.sliding_page_table
        new_kv = None
        if rope is not None and rope.in_kernel and has_cache and dispatch.use_triton(q):
            from homelab_llm.engine.kernels.kv_store import NewKV

            norms = None if qk_norms is None else \
                (qk_norms[0].weight, qk_norms[1].weight, qk_norms[0].eps)
            # rotated and stored by rope_store_kv, or on decode steps by the attention kernel
            new_kv = NewKV(k, v, rope.positions, rope.table, slot_mapping, norms)
        else:
            if qk_norms is not None:
                raise ValueError("attention: q/k norms go into the store kernel only where "
                                 "norms_in_store says so")
            if rope is not None:
                q, k = self._rotate(q, k, rope)
            if not has_cache:
                out = self._no_cache(q, k, v, ctx.query_lens_host, ctx.query_start_loc)
                out = out if gate is None else dispatch.sigmoid_mul(out, gate)
                if pair_block:
                    from homelab_llm.engine.kernels.pair_order import rows_in_pair_order

                    out = rows_in_pair_order(out, pair_block)
                return out
            dispatch.store_kv(k, v, self.k_cache, self.v_cache, slot_mapping,
                              self.k_scale, self.v_scale)
        out = dispatch.paged_attention(
            q, self.k_cache, self.v_cache, page_table, ctx.query_start_loc, ctx.seq_lens,
            self.scale, self.k_scale, self.v_scale, ctx.query_lens_host, ctx.seq_lens_host,
            decode_only=ctx.decode_only, num_kv_splits=ctx.num_kv_splits, window=self.window,
            sinks=sinks, rows_per_seq=ctx.verify_width if ctx.decode_only else 1, gate=gate,
            new_kv=new_kv, pair_block=pair_block)
        return out.reshape(q.shape[0], -1)

    def project(self, o_proj: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rope: RopeTables | None = None, gate: torch.Tensor | None = None,
                qk_norms: tuple[nn.Module, nn.Module] | None = None) -> torch.Tensor:
        """o_proj(forward(...)): the output handed over in the pair order o_proj's W4A16
        few-row kernel reads (LinearBase.rows_pairs_block), written so by the decode kernels,
        so o_proj needs no reorder launch of its own."""
        pairs = o_proj.rows_pairs_block(q.shape[0], q)
        out = self.forward(q, k, v, rope, gate, qk_norms, pair_block=pairs)
        return o_proj(out, paired=pairs > 0)

    @staticmethod
    def _rotate(q: torch.Tensor, k: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        if rope.in_kernel:
            dispatch.apply_rope(q, k, rope.positions, rope.table)  # in place
            return q, k
        assert rope.cos is not None and rope.sin is not None
        return apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin)

    def _no_cache(self, q, k, v, query_lens: list[int] | None, query_start_loc) -> torch.Tensor:
        """Causal attention within each sequence's new tokens only: the runner's memory-profiling
        forward, which runs before any cache exists (every sequence is a fresh prefill)."""
        if query_lens is None:
            starts = query_start_loc.tolist()
            query_lens = [b - a for a, b in zip(starts, starts[1:])]
        out = torch.empty_like(q)
        start = 0
        for n in query_lens:
            pos = torch.arange(n, device=q.device)
            mask = pos[None, :] <= pos[:, None]
            if self.window:
                mask &= pos[None, :] > pos[:, None] - self.window
            o = attend_ref(q[start:start + n].transpose(0, 1), k[start:start + n].transpose(0, 1),
                           v[start:start + n].transpose(0, 1), mask, self.scale, self.sinks)
            out[start:start + n] = o.transpose(0, 1)
            start += n
        return out.reshape(q.shape[0], -1)
