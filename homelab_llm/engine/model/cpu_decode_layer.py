"""CPU steps of few new tokens of a Llama-style model in the fewest torch ops (LlamaModel.forward).

A batch-1 decode step of a small model on the CPU spends about as long dispatching its small ops
as in its matmuls (SmolLM2-135M at 2 threads: ~3.7 ms of small ops against ~5 ms of int4 matmuls
per token with ~25 ops a layer, F.rms_norm alone being 7 aten ops). Each small op costs 1-3 us
however little it computes, mixed-dtype ops and out= variants of some ops about twice a plain
one, so this path runs a layer in few calls: with our C kernels, 5 (qkv with its norm,
attention, o, gate_up with its norm, down with silu(gate) * up: SmolLM2 decode at 2 threads on
an AVX2 EPYC 1.08x llama.cpp's, docs/BENCHMARKS.md 53); with torch's, ~21:
- everything static is looked up once (CpuDecodePlan: the linears, norm weights, caches' views);
- a linear is one call: our AVX2 kernel (kernels/q4_native.py) reads fp32 and writes or adds
  its fp32 result in place (o and down add straight into the residual stream), and the RMSNorm
  in front of qkv and gate_up happens inside that call, on the row it quantizes; torch's int4
  kernel (where ours does not run) takes the norm as one dot product (its sum of squares, read
  back as a float) and one addcmul into a buffer, and copies its input to bf16 and its result
  back;
- attention where our kernels run is one C call (kernels/decode_attention_native.py: rotation,
  cache store, attention through the page table); else q and k are rotated together by one
  [D, D] matmul with the step's rotation matrix (cos on the diagonal, -/+ sin half a head off
  it), built once per step, K/V rows go into the cache with index_copy_, attention reads the
  cache through a strided view when the sequence's pages are consecutive (the common case),
  else it gathers them, and the query heads of a KV head are one SDPA "query row" group (no
  K/V expansion), on one thread (kernels/cpu_threads.py);
- the residual stream stays fp32 and is added to in place.
With our kernels a step may hold up to MAX_ROWS new tokens, at most SEQ_ROWS of a sequence, in
any mix (several sequences' decode tokens, speculative verify steps' drafted tokens, a short
prompt; a prompt chunk of more tokens takes the general path's dense fp32 copy, near exact): each
linear takes all rows in one call and the attention call attends each row over its own
sequence's positions up to its own (docs/BENCHMARKS.md 54: n-gram speculation 0.65x -> 1.4-2.1x,
decode of 8 / 32 sequences 1.9x / 2.0x llama.cpp's). A row's numbers do not depend on the rows
beside it (the kernels sum each row in one fixed order), so speculative output equals plain
output token for token.
The numbers are the general path's up to fp32 rounding order (the norm's sum, the rotation's
FMAs, the softmax's polynomial exponential) and the int8 / bf16 roundings that follow from it:
tests/engine/test_cpu_decode_layer.py bounds the difference (inside the CPU default's own
distance from the exact fp32 path).

Taken only when every layer is a plain LlamaDecoderLayer of the CPU default (all linears through
a CPU 4-bit kernel, SiLU MLP, no window/sinks, one rank; a qkv bias (Qwen2) or q / k norms
(Qwen3) only with our attention call, no other bias) and a step has at most MAX_ROWS new tokens,
SEQ_ROWS a sequence (with torch's kernels: one sequence's one token), over an fp32 cache (not
int8). Anything else: None, and the caller runs the general path.
Invariant: a plan is built for the packs present when it was built; `current` notices a repack.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from homelab_llm.engine.context import ForwardContext
from homelab_llm.engine.kernels import decode_attention_native, q4_native
from homelab_llm.engine.kernels.cpu_threads import single_thread
from homelab_llm.engine.kernels.q4_native import NativeLinear
from homelab_llm.engine.kernels.w4a16_cpu import NATIVE_ROWS
from homelab_llm.engine.layers.norm import RMSNorm
from homelab_llm.engine.model.llama import LlamaDecoderLayer, LlamaMLP
from homelab_llm.engine.parallel.state import tp_size

# The most new tokens a step may have on this path (a batch of decode or verify steps; our 4-bit
# kernel beats the dense fp32 GEMM per row up to 256 rows), and of one sequence (fewer than the
# rows from which the general path takes the dense copy: prompts stay near exact).
MAX_ROWS, SEQ_ROWS = 64, NATIVE_ROWS - 1

_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu if \
    hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") else None


@dataclass
class CpuLayerPlan:
    """One decoder layer's static inputs; the cache views are refreshed when the runner rebinds."""

    attn: nn.Module  # layers.attention.Attention: k_cache / v_cache are read from it
    norm1: torch.Tensor
    norm2: torch.Tensor
    # Each linear as a callable (x [1, K] fp32, out [1, N] fp32, accumulate=False): NativeLinear
    # (our AVX2 kernel) or Int4Linear (torch's int4 kernel).
    qkv: Callable
    o: Callable
    gate_up: Callable
    down: Callable
    # The attention call's extras (fp32, contiguous; None where the layer has none): the qkv
    # projection's bias (Qwen2), each q / k head's RMSNorm weight (Qwen3), and their data_ptrs.
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    extras: tuple[int | None, int | None, int | None] = (None, None, None)
    k_cache: torch.Tensor | None = None  # [pages, page_size, Hkv, D]
    v_cache: torch.Tensor | None = None
    k_rows: torch.Tensor | None = None  # [pages * page_size, Hkv, D]: views for the store
    v_rows: torch.Tensor | None = None
    # Storage offsets of the caches (torch.as_strided counts from the storage's start).
    k_offset: int = 0
    v_offset: int = 0

    def __post_init__(self) -> None:
        self.extras = tuple(None if t is None else t.data_ptr() for t in (self.qkv_bias, self.q_norm, self.k_norm))

    def bind(self) -> None:
        k, v = self.attn.k_cache, self.attn.v_cache
        hkv, d = k.shape[2:]
        self.k_cache, self.v_cache = k, v
        self.k_rows, self.v_rows = k.view(-1, hkv, d), v.view(-1, hkv, d)
        self.k_offset, self.v_offset = k.storage_offset(), v.storage_offset()


class Int4Linear:
    """A linear through torch's int4 kernel, called as NativeLinear is: with norm, RMSNorm is one
    dot product (its sum of squares, read back as a float) and one addcmul (x * rsqrt(mean +
    eps) * w), with swiglu silu(gate) * up, into a staging buffer; x goes to bf16 in a buffer of
    its own, the result is copied or added into out."""

    __slots__ = ("args", "x", "staged", "eps", "inv_k", "zero")

    def __init__(self, pack, eps: float):
        self.args = (pack.packed, pack.group_size, pack.scales_and_zeros)
        self.x = torch.empty(1, pack.in_features, dtype=torch.bfloat16)
        self.staged = torch.empty(1, pack.in_features)  # the normed row or the gated activation
        self.eps, self.inv_k, self.zero = eps, 1.0 / pack.in_features, torch.zeros(())

    def __call__(self, x: torch.Tensor, out: torch.Tensor, accumulate: bool = False,
                 norm: torch.Tensor | None = None, swiglu: bool = False) -> None:
        if swiglu:  # x holds gate then up
            k = self.staged.shape[1]
            x = torch.mul(F.silu(x[:, :k]), x[:, k:], out=self.staged)
        elif norm is not None:
            flat = x[0]
            x = torch.addcmul(self.zero, x, norm, out=self.staged,
                              value=1.0 / math.sqrt(torch.dot(flat, flat).item() * self.inv_k + self.eps))
        self.x.copy_(x)
        y = _int4_mm(self.x, *self.args)
        if accumulate:
            out.add_(y)
        else:
            out.copy_(y)


def _linear(linear: nn.Module, eps: float, bias_ok: bool = False) -> Callable | None:
    """The linear's callable, or None where neither kernel takes it (bias_ok: the caller adds
    the bias elsewhere)."""
    w4 = getattr(linear, "w4", None)
    pack = None if w4 is None else w4.cpu_pack
    if pack is None or pack.perm is not None or (linear.bias is not None and not bias_ok):
        return None
    if pack.native is not None:
        return NativeLinear(pack.native, eps)
    return Int4Linear(pack, eps) if _int4_mm is not None else None


class CpuDecodePlan:
    """The fast decode of one LlamaModel (see the module docstring); build() says if it applies."""

    def __init__(self, model: nn.Module, layers: list[CpuLayerPlan], native: bool):
        first = model.layers[0].self_attn
        self.anchor = first.qkv_proj.w4.cpu_pack
        self.layers = layers
        self.q_heads, self.kv_heads = first.num_heads, first.num_kv_heads
        self.head_dim, self.scale = first.head_dim, first.attn.scale
        self.q_size, self.kv_size = first.q_size, first.kv_size
        self.inter = model.layers[0].mlp.down_proj.in_features
        self.cos_sin = model.rotary.cos_sin
        # Attention as one C call where it runs (native: see build), else torch ops (_torch_attention).
        qk_eps = first.q_norm.eps if first.qk_norm else 0.0
        self.native_attention = decode_attention_native.DecodeAttention(
            first.num_heads, first.num_kv_heads, first.head_dim, first.attn.scale, qk_eps) if native else None
        d = self.head_dim
        # Per-step buffers (one layer at a time uses them), max_rows rows: fp32 q|k|v and
        # gate|up, attention's output; the torch path's views of their first row.
        self.max_rows = MAX_ROWS if self.native_attention is not None else 1
        self.qkv_buf = torch.empty(self.max_rows, self.q_size + 2 * self.kv_size)
        self.qk_in = self.qkv_buf[0, : self.q_size + self.kv_size].view(-1, d)
        self.v_new = self.qkv_buf[:1, self.q_size + self.kv_size:].view(1, self.kv_heads, d)
        self.qk_rot = torch.empty(self.q_heads + self.kv_heads, d)
        self.q_grouped = self.qk_rot[: self.q_heads].view(
            1, self.kv_heads, self.q_heads // self.kv_heads, d)
        self.k_new = self.qk_rot[self.q_heads:].view(1, self.kv_heads, d)
        self.gu_buf = torch.empty(self.max_rows, 2 * self.inter)
        self.attn = torch.empty(self.max_rows, self.q_size)
        # SDPA's output shape [1, Hkv, Hq / Hkv, D] over the first row.
        self.attn_heads = self.attn[:1].view(self.q_grouped.shape)
        self.rotation = torch.zeros(d, d)
        # Our kernels' path: the residual stream, each row's cos | sin and the attention call's
        # row triples in buffers of their own, so each row count's calls are bound once (bound:
        # rows -> _bind's lists; cleared when the caches move).
        self.residual = torch.empty(self.max_rows, model.norm.weight.shape[0])
        self.cos_buf = torch.empty(self.max_rows, d)
        self.info = (ctypes.c_int64 * (3 * self.max_rows))()
        self.bound: dict[int, tuple[list, list]] = {}

    @staticmethod
    def build(model: nn.Module) -> CpuDecodePlan | None:
        """A plan for `model` (a LlamaModel after model/cpu_kernels.use_cpu_kernels), or None."""
        table = model.rotary.cos_sin
        # rotation_matrix rotates every dimension of a head: a full-width fp32 table only.
        if tp_size() != 1 or table.dtype != torch.float32 \
                or table.shape[-1] != model.layers[0].self_attn.head_dim:
            return None
        first = model.layers[0].self_attn
        # Our attention call where it runs and every linear is on our kernel (both need the same
        # CPU); only it takes a qkv bias or q / k norms.
        native = decode_attention_native.available(first.num_heads, first.num_kv_heads, first.head_dim)
        plans, eps, qk_eps = [], None, None
        for layer in model.layers:
            attn_mod, mlp = layer.self_attn, layer.mlp
            if type(layer) is not LlamaDecoderLayer or type(mlp) is not LlamaMLP or mlp.gated_act != "silu":
                return None
            attn = attn_mod.attn
            if attn.window or attn.sinks is not None or attn.sliding_group:
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            qk = (attn_mod.q_norm, attn_mod.k_norm) if attn_mod.qk_norm else ()
            if any(type(n) is not RMSNorm for n in qk):  # Gemma's (1 + weight) norms: not ours
                return None
            bias = attn_mod.qkv_proj.bias
            if any(n.weight.dtype != torch.float32 or not n.weight.is_contiguous() for n in norms + qk) \
                    or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous())):
                return None
            if {norms[0].eps, norms[1].eps, eps or norms[0].eps} != {norms[0].eps}:
                return None
            if qk and {qk[0].eps, qk[1].eps, qk_eps or qk[0].eps} != {qk[0].eps}:
                return None
            eps, qk_eps = norms[0].eps, qk[0].eps if qk else None
            packs = [_linear(attn_mod.qkv_proj, eps, bias_ok=True), _linear(attn_mod.o_proj, eps),
                     _linear(mlp.gate_up_proj, eps), _linear(mlp.down_proj, eps)]
            if any(p is None for p in packs):
                return None
            native = native and isinstance(packs[0], NativeLinear)
            plans.append(CpuLayerPlan(attn, norms[0].weight, norms[1].weight, *packs, qkv_bias=bias,
                                      q_norm=qk[0].weight if qk else None, k_norm=qk[1].weight if qk else None))
        if not native and any(lp.qkv_bias is not None or lp.q_norm is not None for lp in plans):
            return None  # torch's attention path has neither
        return CpuDecodePlan(model, plans, native) if plans else None

    def current(self, model: nn.Module) -> bool:
        """Whether the model's int4 packs are still those this plan holds."""
        return model.layers[0].self_attn.qkv_proj.w4.cpu_pack is self.anchor

    def decode(self, hidden: torch.Tensor, positions: torch.Tensor,
               ctx: ForwardContext) -> torch.Tensor | None:
        """hidden [R, H] fp32 embeddings of a step's new tokens (R <= max_rows, SEQ_ROWS a
        sequence; with torch's attention one sequence's one token) -> the residual stream after
        the last layer (x + residual, before the final norm; with our kernels a view of a buffer
        the next step overwrites); None when the step is not this path's (see the module
        docstring)."""
        rows, q_lens, s_lens = hidden.shape[0], ctx.query_lens_host, ctx.seq_lens_host
        if not q_lens or s_lens is None or rows > self.max_rows or sum(q_lens) != rows \
                or max(q_lens) > SEQ_ROWS \
                or hidden.dtype != torch.float32 or os.environ.get("HOMELAB_LLM_KERNELS") == "ref":
            return None
        layers = self.layers
        for lp in layers:
            if lp.attn.k_cache is not lp.k_cache:
                if lp.attn.k_cache is None or lp.attn.k_cache.dtype != torch.float32:
                    return None
                lp.bind()
                self.bound.clear()  # the bound calls point at the old caches
        slot, table = ctx.slot_mapping, ctx.page_table
        if slot.dtype != torch.int64:
            return None
        slots = slot.tolist()
        if min(slots) < 0:
            return None
        if self.native_attention is not None and table.dtype == torch.int32 and table.stride(1) == 1:
            decode_attention_native.row_info(q_lens, s_lens, slots, into=self.info)
            torch.index_select(self.cos_sin, 0, positions, out=self.cos_buf[:rows])
            return self._bound_layers(hidden, table)
        if rows == 1:
            seq_len = s_lens[0]
            pages = table[0, : (seq_len + layers[0].k_cache.shape[1] - 1) // layers[0].k_cache.shape[1]]
            return self._layers(hidden, self._torch_attention(self.rotation_matrix(positions), slot, seq_len, pages))
        return None

    def rotation_matrix(self, positions: torch.Tensor) -> torch.Tensor:
        """The [D, D] matrix R with rotate(x) = x @ R at this position: layers/rotary's
        x * cos + rotate_half(x) * sin, i.e. out[j] = x[j] cos[j] -/+ x[j +/- D/2] sin[j]."""
        cos, sin = self.cos_sin[positions[0]].chunk(2)
        r, half = self.rotation, self.head_dim // 2
        r.diagonal().copy_(torch.cat((cos, cos)))
        r.diagonal(half).copy_(sin)
        torch.neg(sin, out=r.diagonal(-half))
        return r

    def _bound_layers(self, hidden: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Every layer through our kernels' struct calls (bound once per row count: the buffers,
        weights and caches stay put; the page table is set each step), on the residual buffer;
        cos_buf and info hold the step's rows (decode)."""
        rows = hidden.shape[0]
        calls, attends = self.bound.get(rows) or self._bind(rows)
        table_ptr, table_stride = table.data_ptr(), table.stride(0)
        for call in attends:
            call.page_table, call.table_stride = table_ptr, table_stride
        residual = self.residual[:rows]
        residual.copy_(hidden)
        for fn, ref in calls:
            code = fn(ref)
            if code:
                raise MemoryError(f"native CPU kernel call failed ({code}): no memory for its scratch")
        return residual

    def _bind(self, rows: int) -> tuple[list, list]:
        """(the step's calls in order: (C function, struct reference), the attention structs) for
        `rows` rows."""
        qkv, gu, attn, residual = self.qkv_buf[:rows], self.gu_buf[:rows], self.attn[:rows], self.residual[:rows]
        matmul, attend = q4_native.library().q_matmul_call, self.native_attention.fn
        calls, attends = [], []
        for lp in self.layers:
            call = self.native_attention.bind(qkv, self.cos_buf[:rows], lp.k_cache, lp.v_cache, self.info, attn,
                                              *lp.extras)
            attends.append(call)
            for fn, struct in ((matmul, lp.qkv.bind(residual, qkv, False, lp.norm1)),  # RMSNorm inside
                               (attend, call),
                               (matmul, lp.o.bind(attn, residual, True)),
                               (matmul, lp.gate_up.bind(residual, gu, False, lp.norm2)),
                               (matmul, lp.down.bind(gu, residual, True, None, True))):  # silu(gate) * up
                calls.append((fn, ctypes.byref(struct)))  # the reference keeps the struct alive
        self.bound[rows] = calls, attends
        return calls, attends

    def _torch_attention(self, rotation: torch.Tensor, slot: torch.Tensor, seq_len: int,
                         pages: torch.Tensor) -> Callable[[CpuLayerPlan], None]:
        """A layer's attention in torch ops on one thread, into self.attn: q and k rotated by one
        matmul, K/V rows stored with index_copy_, SDPA over the cache (a strided view when the
        pages are consecutive, else gathered)."""
        sdpa, mat, strided = F.scaled_dot_product_attention, torch.mm, torch.as_strided
        scale, hkv, d = self.scale, self.kv_heads, self.head_dim
        qk_in, v_new, qk_rot, q, k_new = self.qk_in, self.v_new, self.qk_rot, self.q_grouped, self.k_new
        attn_heads = self.attn_heads
        page_size = self.layers[0].k_cache.shape[1]
        first = int(pages[0])
        # Consecutive pages (the usual layout of a lone sequence): attention reads a view.
        consecutive = pages.tolist() == list(range(first, first + len(pages)))
        kv_shape, kv_stride = (1, hkv, seq_len, d), (0, d, hkv * d, 1)
        kv_offset = first * page_size * hkv * d

        def attend(lp: CpuLayerPlan) -> None:
            with single_thread():
                mat(qk_in, rotation, out=qk_rot)
                lp.k_rows.index_copy_(0, slot, k_new)
                lp.v_rows.index_copy_(0, slot, v_new)
                if consecutive:
                    k = strided(lp.k_cache, kv_shape, kv_stride, lp.k_offset + kv_offset)
                    v = strided(lp.v_cache, kv_shape, kv_stride, lp.v_offset + kv_offset)
                else:  # scattered pages: gather them
                    k = lp.k_cache.index_select(0, pages).view(-1, hkv, d)[:seq_len] \
                        .transpose(0, 1).unsqueeze(0)
                    v = lp.v_cache.index_select(0, pages).view(-1, hkv, d)[:seq_len] \
                        .transpose(0, 1).unsqueeze(0)
                attn_heads.copy_(sdpa(q, k, v, scale=scale))

        return attend

    def _layers(self, residual: torch.Tensor, attend: Callable[[CpuLayerPlan], None]) -> torch.Tensor:
        rows = residual.shape[0]
        qkv_buf, gu_buf, attn = self.qkv_buf[:rows], self.gu_buf[:rows], self.attn[:rows]
        residual = residual.clone()
        for lp in self.layers:
            lp.qkv(residual, qkv_buf, False, lp.norm1)  # RMSNorm inside the linear's call
            attend(lp)
            lp.o(attn, residual, True)
            lp.gate_up(residual, gu_buf, False, lp.norm2)
            lp.down(gu_buf, residual, True, None, True)  # silu(gate) * up inside the call
        return residual
