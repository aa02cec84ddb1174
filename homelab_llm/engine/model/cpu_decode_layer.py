"""One-sequence CPU decode of a Llama-style model in the fewest torch ops (LlamaModel.forward).

A batch-1 decode step of a small model on the CPU spends about as long dispatching its small ops
as in its matmuls (SmolLM2-135M at 2 threads: ~8 ms each of a ~16.6 ms step, ~52 ops per layer on
the general path). This path runs the same math in ~23 ops per layer and little Python:
- everything static is looked up once (CpuDecodePlan: the int4 packs, norm weights, caches' views);
- q and k are rotated together, into a buffer, with cos/sin gathered once per step;
- K/V rows go into the cache with index_copy_; when the sequence's pages are consecutive (the
  common case) attention reads the cache through a strided view, else it gathers the pages;
- the query heads of a KV head are one SDPA "query row" group (no K/V expansion), on one thread
  (kernels/cpu_threads.py);
- the residual stream stays fp32 and is added to in place; the int4 kernel's bf16 outputs are
  added or copied into fp32 buffers directly (the same numbers as the general path's casts).

Taken only when every layer is a plain LlamaDecoderLayer of the CPU default (all linears through
the int4 CPU kernel, no biases, no q/k norm, SiLU MLP, no window/sinks, one rank) and a step has
one sequence with one new token over an fp32 cache (not int8). Anything else: None, and the caller
runs the general path. tests/engine/test_cpu_decode_layer.py compares the two.
Invariant: a plan is built for the packs present when it was built; `current` notices a repack.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from homelab_llm.engine.context import ForwardContext
from homelab_llm.engine.kernels.cpu_threads import single_thread
from homelab_llm.engine.model.llama import LlamaDecoderLayer, LlamaMLP
from homelab_llm.engine.parallel.state import tp_size

_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu if \
    hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") else None


@dataclass
class CpuLayerPlan:
    """One decoder layer's static inputs; the cache views are refreshed when the runner rebinds."""

    attn: nn.Module  # layers.attention.Attention: k_cache / v_cache are read from it
    norm1: torch.Tensor
    norm2: torch.Tensor
    qkv: tuple  # (packed, group_size, scales_and_zeros) of each int4 linear
    o: tuple
    gate_up: tuple
    down: tuple
    k_cache: torch.Tensor | None = None
    k_rows: torch.Tensor | None = None  # [pages * page_size, Hkv, D]
    v_rows: torch.Tensor | None = None
    k_heads: torch.Tensor | None = None  # [1, Hkv, pages * page_size, D]: SDPA's layout, a view
    v_heads: torch.Tensor | None = None

    def bind(self) -> None:
        k, v = self.attn.k_cache, self.attn.v_cache
        hkv, d = k.shape[2:]
        self.k_cache = k
        self.k_rows, self.v_rows = k.view(-1, hkv, d), v.view(-1, hkv, d)
        self.k_heads = self.k_rows.permute(1, 0, 2).unsqueeze(0)
        self.v_heads = self.v_rows.permute(1, 0, 2).unsqueeze(0)


def _pack(linear: nn.Module) -> tuple | None:
    w4 = getattr(linear, "w4", None)
    pack = None if w4 is None else w4.cpu_pack
    if pack is None or pack.perm is not None or linear.bias is not None:
        return None
    return pack.packed, pack.group_size, pack.scales_and_zeros


class CpuDecodePlan:
    """The fast decode of one LlamaModel (see the module docstring); build() says if it applies."""

    def __init__(self, model: nn.Module, layers: list[CpuLayerPlan], eps: float):
        first = model.layers[0].self_attn
        self.anchor = first.qkv_proj.w4.cpu_pack
        self.layers, self.eps, self.hidden = layers, eps, model.norm.weight.shape[0]
        self.q_heads, self.kv_heads = first.num_heads, first.num_kv_heads
        self.head_dim, self.scale = first.head_dim, first.attn.scale
        self.q_size, self.kv_size = first.q_size, first.kv_size
        self.inter = model.layers[0].mlp.down_proj.in_features
        self.cos_sin = model.rotary.cos_sin
        d = self.head_dim
        # Per-step buffers (one layer at a time uses them): fp32 q|k|v and gate|up, their views.
        self.qkv_buf = torch.empty(1, self.q_size + 2 * self.kv_size)
        self.qk_in = self.qkv_buf[0, : self.q_size + self.kv_size].view(-1, d)
        self.v_new = self.qkv_buf[:, self.q_size + self.kv_size:].view(1, self.kv_heads, d)
        self.qk_rot = torch.empty(self.q_heads + self.kv_heads, d)
        self.q_grouped = self.qk_rot[: self.q_heads].view(
            1, self.kv_heads, self.q_heads // self.kv_heads, d)
        self.k_new = self.qk_rot[self.q_heads:].view(1, self.kv_heads, d)
        self.gu_buf = torch.empty(1, 2 * self.inter)
        self.gate, self.up = self.gu_buf[:, : self.inter], self.gu_buf[:, self.inter:]
        self.act = torch.empty(1, self.inter)

    @staticmethod
    def build(model: nn.Module) -> CpuDecodePlan | None:
        """A plan for `model` (a LlamaModel after model/cpu_kernels.use_cpu_kernels), or None."""
        if _int4_mm is None or tp_size() != 1 or model.rotary.cos_sin.dtype != torch.float32:
            return None
        plans, eps = [], None
        for layer in model.layers:
            attn_mod, mlp = layer.self_attn, layer.mlp
            if type(layer) is not LlamaDecoderLayer or type(mlp) is not LlamaMLP \
                    or not mlp.silu_gated or attn_mod.qk_norm:
                return None
            attn = attn_mod.attn
            if attn.window or attn.sinks is not None or attn.sliding_group:
                return None
            packs = [_pack(m) for m in (attn_mod.qkv_proj, attn_mod.o_proj, mlp.gate_up_proj,
                                        mlp.down_proj)]
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(p is None for p in packs) or any(n.weight.dtype != torch.float32 for n in norms):
                return None
            if {norms[0].eps, norms[1].eps, eps or norms[0].eps} != {norms[0].eps}:
                return None
            eps = norms[0].eps
            plans.append(CpuLayerPlan(attn, norms[0].weight, norms[1].weight, *packs))
        return CpuDecodePlan(model, plans, eps) if plans else None

    def current(self, model: nn.Module) -> bool:
        """Whether the model's int4 packs are still those this plan holds."""
        return model.layers[0].self_attn.qkv_proj.w4.cpu_pack is self.anchor

    def decode(self, hidden: torch.Tensor, positions: torch.Tensor,
               ctx: ForwardContext) -> torch.Tensor | None:
        """hidden [1, H] fp32 embeddings of one sequence's one new token -> the residual stream
        after the last layer (x + residual, before the final norm); None when the step is not
        this path's (see the module docstring)."""
        if ctx.query_lens_host != [1] or ctx.seq_lens_host is None or hidden.shape[0] != 1 \
                or hidden.dtype != torch.float32 or os.environ.get("HOMELAB_LLM_KERNELS") == "ref":
            return None
        layers = self.layers
        for lp in layers:
            if lp.attn.k_cache is not lp.k_cache:
                if lp.attn.k_cache is None or lp.attn.k_cache.dtype != torch.float32:
                    return None
                lp.bind()
        slot = ctx.slot_mapping
        if slot.dtype != torch.int64 or int(slot[0]) < 0:
            return None
        seq_len = ctx.seq_lens_host[0]
        page_size = layers[0].k_cache.shape[1]
        pages = ctx.page_table[0, : (seq_len + page_size - 1) // page_size]
        first = int(pages[0])
        # Consecutive pages (the usual layout of a lone sequence): attention reads a view.
        start = first * page_size if pages.tolist() == list(range(first, first + len(pages))) \
            else None
        cos, sin = self._rotation(positions)
        return self._layers(hidden, cos, sin, slot, seq_len, start, pages)

    def _rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width cos and signed sin [D] at this position (layers/rotary.apply_rotary's)."""
        cos, sin = self.cos_sin[positions[0]].chunk(2)
        return torch.cat((cos, cos)), torch.cat((-sin, sin))

    def _layers(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot: torch.Tensor, seq_len: int,
                start: int | None, pages: torch.Tensor) -> torch.Tensor:
        mm, rms_norm, sdpa, silu, bf16 = _int4_mm, F.rms_norm, F.scaled_dot_product_attention, \
            torch.ops.aten.silu.out, torch.bfloat16
        shape, eps, scale = (self.hidden,), self.eps, self.scale
        qkv_buf, qk_in, v_new, qk_rot, q, k_new = self.qkv_buf, self.qk_in, self.v_new, \
            self.qk_rot, self.q_grouped, self.k_new
        gu_buf, gate, up, act = self.gu_buf, self.gate, self.up, self.act
        out_shape = (1, self.q_size)
        hkv, d = self.kv_heads, self.head_dim
        half = d // 2
        residual = residual.clone()
        x = None
        for lp in self.layers:
            if x is not None:
                residual.add_(x)
            h = rms_norm(residual, shape, lp.norm1, eps).to(bf16)
            qkv_buf.copy_(mm(h, *lp.qkv))
            with single_thread():
                # apply_rotary's ops, into a buffer: the same numbers as the general path.
                torch.mul(qk_in, cos, out=qk_rot)
                qk_rot.addcmul_(qk_in.roll(half, -1), sin)
                lp.k_rows.index_copy_(0, slot, k_new)
                lp.v_rows.index_copy_(0, slot, v_new)
                if start is not None:
                    k = lp.k_heads.narrow(2, start, seq_len)
                    v = lp.v_heads.narrow(2, start, seq_len)
                else:  # scattered pages: gather them
                    k = lp.k_cache.index_select(0, pages).view(-1, hkv, d)[:seq_len] \
                        .transpose(0, 1).unsqueeze(0)
                    v = lp.attn.v_cache.index_select(0, pages).view(-1, hkv, d)[:seq_len] \
                        .transpose(0, 1).unsqueeze(0)
                o = sdpa(q, k, v, scale=scale)
            residual.add_(mm(o.view(out_shape).to(bf16), *lp.o))
            h = rms_norm(residual, shape, lp.norm2, eps).to(bf16)
            gu_buf.copy_(mm(h, *lp.gate_up))
            silu(gate, out=act)
            act.mul_(up)
            x = mm(act.to(bf16), *lp.down)
        return residual.add_(x)
