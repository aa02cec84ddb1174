"""One door to the kernels: layers call these; each picks the Triton kernel on a GPU and the torch
reference on the CPU (or when HOMELAB_LLM_KERNELS=ref), so CI runs the same engine code.

Triton modules are imported on first GPU use only: a CPU install never needs triton, and importing
this module stays cheap.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from homelab_llm.engine.host_copy import upload_pinned
from homelab_llm.engine.kernels import attention_cpu, ref
from homelab_llm.engine.kernels.cpu_threads import single_thread


def _kernels_env() -> str:
    return os.environ.get("HOMELAB_LLM_KERNELS", "triton")


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and _kernels_env() != "ref"


def int8_v_dim_major(device: torch.device, kv_dtype: torch.dtype) -> bool:
    """Whether an int8 KV cache on `device` keeps V dim-major within each page
    (cache/page_pool.KVLayout.v_dim_major), where the decode loop loads V tiles as vectors and
    on NVIDIA converts them in PTX (docs/BENCHMARKS.md 56): on a GPU under the Triton kernels;
    by default on NVIDIA, where it was timed (BENCHMARKS 57.6, H100, 16K of context: the 27B's
    int8 decode 1.48x faster at batch 1, 1.77x at 8; the 8B engine 158.5 -> 161.8 tok/s), not on
    ROCm, where nothing has timed it. HOMELAB_LLM_KV_V_LAYOUT=dim or =token chooses on any GPU."""
    if kv_dtype != torch.int8 or device.type != "cuda" or _kernels_env() == "ref":
        return False
    default = "token" if torch.version.hip is not None else "dim"
    return os.environ.get("HOMELAB_LLM_KV_V_LAYOUT", default) == "dim"


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    if use_triton(key):
        from homelab_llm.engine.kernels import kv_store

        kv_store.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    if key.device.type == "cpu" and _kernels_env() != "ref" and \
            attention_cpu.store_kv(key, value, k_cache, v_cache, slot_mapping):
        return
    ref.store_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(q, k_cache, v_cache, page_table, query_start_loc, seq_lens, softmax_scale,
                    k_scale=None, v_scale=None, query_lens_host=None, seq_lens_host=None,
                    decode_only: bool | None = None, num_kv_splits: int | None = None,
                    window: int = 0, sinks: torch.Tensor | None = None, rows_per_seq: int = 1,
                    gate: torch.Tensor | None = None, new_kv=None, pair_block: int = 0):
    """Causal attention of new tokens over their paged KV (see ref.paged_attention_ref); window
    > 0 for a sliding-window layer, sinks [Hq] float32 for gpt-oss's per-head sink logits; gate
    [T, Hq, D] (gated attention; may be strided) multiplies the output by sigmoid(gate).

    On a GPU, a batch where every sequence has one new token takes the split-KV decode kernel
    (which applies the gate in its merge); anything else the prefill/extend kernel. Which one is
    known from `decode_only` or the host query lengths; without either we take the extend kernel,
    which is right for every batch. A CUDA-graph runner passes decode_only=True and a fixed
    num_kv_splits. rows_per_seq > 1 (decode only): rows come in groups sharing a page table (a
    speculative verify's K+1 rows, row j seeing its own seq_len): the decode kernel reads each
    group's K/V once. Every row is an independent query either way, so the reference ignores it.

    new_kv (Triton only; a kv_store.NewKV): q and the step's K/V rows arrive unrotated, not yet
    in the cache. Where the arch's decode tiles say so (AttentionTiles.new_kv) a decode batch of
    one-token rows hands them to the decode kernel, which rotates and stores them itself; any
    other batch goes through kv_store.rope_store_kv first (with new_kv.qk_norm q is then a new
    tensor).

    pair_block: each row's Hq * D values in that pair order (kernels/pair_order.py), the out
    projection's W4A16 few-row input: written so by the decode kernels, reordered after the
    others."""
    decode = use_triton(q) and (decode_only or (decode_only is None and query_lens_host is not None
                                                and all(n == 1 for n in query_lens_host)))
    if new_kv is not None:
        from homelab_llm.engine.kernels import kv_store
        from homelab_llm.engine.kernels.tuning import decode_tiles

        fused = decode_tiles(q.device, k_cache.dtype == torch.int8, q.shape[-1], q.shape[0]).new_kv
        if not (decode and rows_per_seq == 1 and fused):
            q = kv_store.rope_store_kv(q, new_kv.key, new_kv.value, new_kv.positions,
                                       new_kv.cos_sin_cache, k_cache, v_cache, new_kv.slot_mapping,
                                       k_scale, v_scale, qk_norm=new_kv.qk_norm)
            new_kv = None
    if decode:
        from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

        max_seq_len = max(seq_lens_host) if seq_lens_host else None
        return paged_decode_attention(q, k_cache, v_cache, page_table, query_start_loc, seq_lens,
                                      softmax_scale, k_scale, v_scale, num_splits=num_kv_splits,
                                      max_seq_len=max_seq_len, window=window, sinks=sinks,
                                      rows_per_seq=rows_per_seq, gate=gate, new_kv=new_kv,
                                      pair_block=pair_block)
    out = _attention_ungated(q, k_cache, v_cache, page_table, query_start_loc, seq_lens,
                             softmax_scale, k_scale, v_scale, query_lens_host, seq_lens_host,
                             window, sinks)
    out = out if gate is None else sigmoid_mul(out.reshape(q.shape[0], -1), gate).view(out.shape)
    if pair_block:
        from homelab_llm.engine.kernels.pair_order import rows_in_pair_order

        out = rows_in_pair_order(out, pair_block)
    return out


def _attention_ungated(q, k_cache, v_cache, page_table, query_start_loc, seq_lens, softmax_scale,
                       k_scale, v_scale, query_lens_host, seq_lens_host, window, sinks):
    """paged_attention's reference and prefill/extend routes."""
    if not use_triton(q):
        if (q.device.type == "cpu" and query_lens_host == [1] and seq_lens_host is not None
                and window == 0 and sinks is None and _kernels_env() != "ref"):
            out = attention_cpu.decode_one_sequence(q, k_cache, v_cache, page_table,
                                                    seq_lens_host[0], softmax_scale)
            if out is not None:
                return out
        return ref.paged_attention_ref(q, k_cache, v_cache, page_table, query_start_loc, seq_lens,
                                       softmax_scale, k_scale, v_scale, query_lens_host, seq_lens_host,
                                       window=window, sinks=sinks)
    from homelab_llm.engine.kernels.prefill_attention import paged_prefill_attention

    max_query_len = max(query_lens_host) if query_lens_host else None
    return paged_prefill_attention(q, k_cache, v_cache, page_table, query_start_loc, seq_lens,
                                   softmax_scale, k_scale, v_scale, max_query_len=max_query_len,
                                   window=window, sinks=sinks)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        from homelab_llm.engine.kernels import elementwise

        return elementwise.rms_norm(x, weight, eps)
    return ref.rms_norm_ref(x, weight, eps)


def qk_norm(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int,
            q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
            q_step: int | None = None) -> torch.Tensor:
    if use_triton(qkv):
        from homelab_llm.engine.kernels import elementwise

        return elementwise.qk_norm(qkv, q_heads, kv_heads, head_dim, q_weight, k_weight, eps, q_step)
    return ref.qk_norm_ref(qkv, q_heads, kv_heads, head_dim, q_weight, k_weight, eps, q_step)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, H * D] * sigmoid(gate [T, H, D]) (gate may be strided); one launch on a GPU."""
    if use_triton(x):
        from homelab_llm.engine.kernels import elementwise

        return elementwise.sigmoid_mul(x, gate)
    return ref.sigmoid_mul_ref(x, gate)


def add_rms_norm(x, residual, weight, eps):
    if use_triton(x):
        from homelab_llm.engine.kernels import elementwise

        return elementwise.add_rms_norm(x, residual, weight, eps)
    return ref.add_rms_norm_ref(x, residual, weight, eps)


FORCED_GEMV_ROWS = 4  # HOMELAB_LLM_DENSE_GEMV=1 on an arch whose table keeps the BLAS GEMM
# Outputs at most this narrow take the GEMV on every arch (up to SKINNY_GEMV_ROWS rows); 0: none.
# Each arch's table may name a width of its own (DenseGemvTiles.skinny_n: sm_90 takes Gated
# DeltaNet's in_proj_ba, 5120 -> 96, at 2-4 rows too, where cuBLAS runs split-K plus a reduce
# launch; docs/BENCHMARKS.md 17.2). At 5-8 rows (a batch-8 step) cuBLAS won on the H100 (27B
# batch 8: 716.6 against 700.8 tok/s, BENCHMARKS 43), so dispatch stops at 4 rows (the GEMV's
# row groups serve 5-8 rows to direct calls). HOMELAB_LLM_DENSE_GEMV=1 forces it (with any width).
SKINNY_GEMV_N = 0
SKINNY_GEMV_ROWS = 4  # at most dense_gemv.MAX_ROWS (past 4 rows, each program takes a group of 4)


def dense_gemv_route(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x [M, K] @ weight.T takes the decode GEMV (kernels/dense_gemv.py): a GPU, 1 to the arch
    table's max_rows rows (tuning.DENSE_GEMV_TABLE; SKINNY_GEMV_ROWS for a weight of at most
    SKINNY_GEMV_N or the table's skinny_n outputs), bf16/fp16 in the weight's dtype, rows contiguous.
    HOMELAB_LLM_DENSE_GEMV=0 keeps the BLAS GEMM, =1 takes the GEMV for up to FORCED_GEMV_ROWS
    rows where the table has it off (benchmarks compare both)."""
    forced = os.environ.get("HOMELAB_LLM_DENSE_GEMV", "")
    if not use_triton(x) or x.dim() != 2 or forced == "0":
        return False
    from homelab_llm.engine.kernels.tuning import dense_gemv_tiles

    tiles = dense_gemv_tiles(x.device)
    max_rows = tiles.max_rows
    if weight.shape[0] <= max(SKINNY_GEMV_N, tiles.skinny_n):
        max_rows = max(max_rows, SKINNY_GEMV_ROWS)
    elif forced == "1" and not max_rows:
        max_rows = FORCED_GEMV_ROWS
    if not (0 < x.shape[0] <= max_rows and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(1) == 1 and weight.stride(1) == 1):
        return False
    from homelab_llm.engine.kernels.dense_gemv import words_fit

    return words_fit(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): the decode GEMV where dense_gemv_route says so (its split-K
    reduces in-kernel: no second launch), else F.linear."""
    if dense_gemv_route(x, weight):
        from homelab_llm.engine.kernels.dense_gemv import dense_gemv

        return dense_gemv(x, weight, bias)[0]
    return F.linear(x, weight, bias)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                gated: bool = False, act: str = "silu") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(linear(rms_norm(x + residual)), x + residual or None without a residual); gated: the
    merged [gate | up] weight, out = act(gate) * up ("silu" or "gelu_tanh"). One launch on the
    decode GEMV's route, the unfused reference ops elsewhere (dense_gemv_ref.norm_linear_ref)."""
    if dense_gemv_route(x, weight):
        from homelab_llm.engine.kernels.dense_gemv import dense_gemv, words_fit

        if words_fit(residual, norm_weight):
            return dense_gemv(x, weight, bias, norm_weight=norm_weight, eps=eps,
                              residual=residual, gated=gated, act=act)
    from homelab_llm.engine.kernels.dense_gemv_ref import norm_linear_ref

    return norm_linear_ref(x, weight, bias, norm_weight=norm_weight, eps=eps, residual=residual,
                           gated=gated, act=act)


def w4a16_kernel_rows(x: torch.Tensor, weight) -> bool:
    """x [M, K] may be formed for the W4A16 `weight` by a kernel in front of it (its prologue or
    its producer): the GPU path, no act-order permutation, bf16/fp16 rows contiguous."""
    return x.dim() == 2 and x.stride(1) == 1 and w4a16_kernel_dtype(x, weight)


def w4a16_kernel_dtype(like: torch.Tensor, weight) -> bool:
    """Rows in like's dtype on like's device may be formed for the W4A16 `weight` by a kernel in
    front of it: the GPU path, no act-order permutation, bf16/fp16."""
    return use_triton(like) and weight.perm is None and like.dtype in (torch.bfloat16, torch.float16)


def w4a16_prologue_route(x: torch.Tensor, weight) -> bool:
    """x [M, K] into the W4A16 `weight` takes the packed-half GEMV with its input formed in the
    prologue (norm, residual add, SiLU-and-mul: kernels/w4a16_prologue.py): a GPU whose table
    routes M rows to it and has fused tiles for them (tuning.h2_fused_tiles: where the fused
    calls were measured ahead of the separate kernels), no act-order permutation, bf16/fp16
    rows contiguous."""
    if not w4a16_kernel_rows(x, weight):
        return False
    from homelab_llm.engine.kernels.tuning import h2_fused_tiles, w4a16_route

    m = x.shape[0]
    return w4a16_route(m, x.device) == "h2" and h2_fused_tiles(m, x.device) is not None


def w4a16_mma_route(x: torch.Tensor, weight) -> bool:
    """x [M, K] (or gate | up [M, 2K]) into the W4A16 `weight` takes the mma.sync kernel
    (kernels/w4a16_mma.py), its pairs formed in one launch with the norm or the gated
    activation: a GPU whose table (or HOMELAB_LLM_W4A16_MMA) routes M rows there, a weight
    it takes (group 128, no act-order), bf16/fp16 rows contiguous."""
    return w4a16_kernel_rows(x, weight) and w4a16_rows_mma(x.shape[0], x, weight)


def w4a16_mma_pairs(x: torch.Tensor, weight, **form) -> torch.Tensor:
    """x's rows (formed as kernels.w4a16_mma.prep_pairs' keywords say) @ W on the mma kernel:
    two launches, the pairs' and the product's."""
    from homelab_llm.engine.kernels.w4a16_mma import prep_pairs

    return w4a16_prepared_matmul(prep_pairs(x, weight.group_size, **form), weight, x.dtype)


def w4a16_rows_mma(m: int, like: torch.Tensor, weight) -> bool:
    """m contiguous rows that a kernel is yet to write in like's dtype on like's device take the
    W4A16 `weight` on the mma kernel, so that kernel may write them as its pairs instead
    (kernels/w4a16_mma.empty_pairs; the Gated DeltaNet decode's output for its out projection)."""
    if not w4a16_kernel_dtype(like, weight):
        return False
    from homelab_llm.engine.kernels.tuning import w4a16_route
    from homelab_llm.engine.kernels.w4a16_mma import mma_fits

    return w4a16_route(m, like.device) == "mma" and mma_fits(m, weight)


def w4a16_prepared_matmul(pairs: tuple[torch.Tensor, torch.Tensor], weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows already written as the mma kernel's pairs (by their producer, w4a16_rows_mma) @ W,
    out in dtype: one launch."""
    from homelab_llm.engine.kernels.w4a16_mma import w4a16_mma

    xh = pairs[0]
    out = torch.empty((xh.shape[0], weight.out_features), dtype=dtype, device=xh.device)
    return w4a16_mma(xh, weight, out, pairs=pairs)


def w4a16_pairs_block(x: torch.Tensor, weight) -> int:
    """The K step in whose pair order (kernels/pair_order.py) the W4A16 linear for x's rows
    wants its input from the kernel that makes it (the norm, the SiLU-and-mul): a GPU whose
    table routes these rows to the left-operand few-row kernel on tiles that read x so
    (GemmTiles.x_pairs / pair_accs), no act-order permutation, bf16/fp16 rows contiguous; 0
    elsewhere (the input stays in k order)."""
    return w4a16_rows_pairs_block(x.shape[0], x, weight) if w4a16_kernel_rows(x, weight) else 0


def w4a16_rows_pairs_block(m: int, like: torch.Tensor, weight) -> int:
    """w4a16_pairs_block for m contiguous rows that a kernel is yet to write in like's dtype on
    like's device (the Gated DeltaNet decode's output for its out projection)."""
    if not w4a16_kernel_dtype(like, weight):
        return 0
    from homelab_llm.engine.kernels.tuning import w4a16_route
    from homelab_llm.engine.kernels.w4a16_dot import x_pairs_block

    return x_pairs_block(m, weight, like.device) if w4a16_route(m, like.device) == "dotL" else 0


def w4a16_paired_matmul(x: torch.Tensor, weight) -> torch.Tensor:
    """x [M, K] in pair order (at w4a16_pairs_block's step) @ W on the left-operand kernel."""
    from homelab_llm.engine.kernels.w4a16_dot import w4a16_dot

    out = torch.empty((x.shape[0], weight.out_features), dtype=x.dtype, device=x.device)
    return w4a16_dot(x, weight, out, w_left=True, x_paired=True)


def w4a16_norm_matmul(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                      eps: float, weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual) @ W, x + residual or None without a residual) for a W4A16 weight:
    one launch on w4a16_prologue_route; elsewhere the norm's launch, writing its rows in the
    linear's pair order where w4a16_pairs_block asks, then the linear's."""
    return _w4a16_norm(x, residual, norm_weight, eps, weight, False)[:2]


def w4a16_norm_matmul_keep(x: torch.Tensor, residual: torch.Tensor | None,
                           norm_weight: torch.Tensor, eps: float, weight,
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """w4a16_norm_matmul and the normalized rows, for other linears that read the same norm
    (Gated DeltaNet's in_proj_ba beside in_proj_qkvz): on the fused route the GEMV's prologue
    stores them, so no norm launch runs."""
    return _w4a16_norm(x, residual, norm_weight, eps, weight, True)


def _w4a16_norm(x, residual, norm_weight, eps, weight, keep: bool):
    if w4a16_prologue_route(x, weight) and (residual is None or residual.stride(1) == 1):
        from homelab_llm.engine.kernels.w4a16_h2 import w4a16_h2

        out = torch.empty((x.shape[0], weight.out_features), dtype=x.dtype, device=x.device)
        summed = torch.empty_like(x) if residual is not None else None
        normed = torch.empty_like(x) if keep else None
        w4a16_h2(x, weight, out, norm_weight=norm_weight, eps=eps, residual=residual, summed=summed,
                 normed=normed)
        return out, summed, normed
    if w4a16_mma_route(x, weight) and (residual is None or residual.stride(1) == 1):
        summed = torch.empty_like(x) if residual is not None else None
        normed = torch.empty_like(x) if keep else None
        out = w4a16_mma_pairs(x, weight, norm_weight=norm_weight, eps=eps, residual=residual,
                              summed=summed, normed=normed)
        return out, summed, normed
    pairs = w4a16_pairs_block(x, weight)
    if pairs:  # the norm's rows in the linear's pair order (and in k order for the kept rows)
        from homelab_llm.engine.kernels import elementwise

        paired, summed, normed = elementwise.norm_rows(x, residual, norm_weight, eps, pairs, keep)
        return w4a16_paired_matmul(paired, weight), summed, normed
    if residual is None:
        normed, summed = rms_norm(x, norm_weight, eps), None
    else:
        normed, summed = add_rms_norm(x, residual, norm_weight, eps)
    return w4a16_matmul(normed, weight), summed, normed


def w4a16_act_matmul(gate_up: torch.Tensor, weight, act: str = "silu") -> torch.Tensor:
    """act(gate) * up @ W for a W4A16 weight, gate_up [M, 2K], act "silu" or "gelu_tanh": one
    launch on w4a16_prologue_route; elsewhere the act-and-mul's launch, a SiLU writing its rows
    in the linear's pair order where w4a16_pairs_block asks, then the linear's."""
    if w4a16_prologue_route(gate_up, weight):
        from homelab_llm.engine.kernels.w4a16_h2 import w4a16_h2

        out = torch.empty((gate_up.shape[0], weight.out_features), dtype=gate_up.dtype,
                          device=gate_up.device)
        return w4a16_h2(gate_up, weight, out, act_in=act)
    if w4a16_mma_route(gate_up, weight):
        return w4a16_mma_pairs(gate_up, weight, act_in=act)
    pairs = w4a16_pairs_block(gate_up, weight) if act == "silu" else 0
    if pairs:
        from homelab_llm.engine.kernels import elementwise

        return w4a16_paired_matmul(elementwise.silu_and_mul(gate_up, pair_block=pairs), weight)
    return w4a16_matmul(gated_act(gate_up, act), weight)


def gated_act(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """[..., 2 * d] (gate | up) -> act(gate) * up: "silu" (a kernel on GPUs) or "gelu_tanh"
    (torch ops everywhere: ref.gelu_tanh_and_mul_ref)."""
    return silu_and_mul(gate_up) if act == "silu" else ref.gelu_tanh_and_mul_ref(gate_up)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        from homelab_llm.engine.kernels import elementwise

        return elementwise.silu_and_mul(gate_up)
    return ref.silu_and_mul_ref(gate_up)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """In place on q [T, Hq, D] and k [T, Hkv, D], neox layout; cache from ref.rope_cos_sin_cache."""
    if use_triton(q):
        from homelab_llm.engine.kernels import elementwise

        elementwise.apply_rope(q, k, positions, cos_sin_cache)
        return
    ref.apply_rope_ref(q, k, positions, cos_sin_cache)


def w4a16_matmul(x: torch.Tensor, weight) -> torch.Tensor:
    """x [..., K] @ W4Weight -> [..., N] in x's dtype (weight from kernels.w4a16_pack).

    On the CPU, a weight repacked at load (weight.cpu_pack: its layer computes its 4-bit matmuls
    in bf16) takes torch's int4 kernel, or a dequantized bf16 GEMM for many rows, whatever x's
    dtype. Without a pack (a model asked for exact fp32 numerics) the exact reference runs.
    HOMELAB_LLM_KERNELS=ref forces the reference.
    """
    if use_triton(x):
        from homelab_llm.engine.kernels import w4a16

        return w4a16.w4a16_matmul(x, weight)
    if weight.cpu_pack is not None and x.device.type == "cpu" and _kernels_env() != "ref":
        from homelab_llm.engine.kernels.w4a16_cpu import w4a16_matmul_cpu_rows

        return w4a16_matmul_cpu_rows(x, weight)
    return ref.w4a16_matmul_ref(x, weight)


def int8_logits(x: torch.Tensor, packed, dense: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W.T -> float32 [M, N] for the CPU LM head: through `packed` (a
    kernels.int8_cpu.CpuInt8Weight of W), or W's `dense` copy when HOMELAB_LLM_KERNELS=ref."""
    if _kernels_env() == "ref":
        return F.linear(x, dense).float()
    from homelab_llm.engine.kernels.int8_cpu import int8_matmul_cpu

    return int8_matmul_cpu(x, packed)


def route_topk(router_logits: torch.Tensor, top_k: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k router: (weights float32 [T, K], expert ids int32 [T, K]); one kernel launch
    on GPUs (torch's softmax + topk + sort took ~10% of a W4A16 decode step)."""
    if use_triton(router_logits):
        from homelab_llm.engine.kernels.moe_router import route_topk as route_topk_triton

        return route_topk_triton(router_logits, top_k, renormalize)
    from homelab_llm.engine.kernels.moe_ref import route_topk_ref

    return route_topk_ref(router_logits, top_k, renormalize)


def route_gate_topk(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool,
                    shared_gate: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The router from hidden states: route_topk(F.linear(x, gate_weight)), and with a shared
    expert's gate [1, H] its weight sigmoid(F.linear(x, shared_gate)) as float32 [T] (else None).
    On GPUs at decode sizes one launch does it all (kernels/moe_router.py: no cuBLAS call)."""
    if use_triton(x):
        from homelab_llm.engine.kernels import moe_router

        if x.shape[0] <= moe_router.FUSED_MAX_TOKENS:
            return moe_router.route_gate_topk(x, gate_weight, top_k, renormalize, shared_gate)
    weights, ids = route_topk(F.linear(x, gate_weight), top_k, renormalize)
    if shared_gate is None:
        return weights, ids, None
    return weights, ids, torch.sigmoid(F.linear(x, shared_gate).float()).reshape(-1)


def router_norm_route(x: torch.Tensor) -> bool:
    """The MoE router takes the norm in front of the experts into its launch
    (route_gate_topk_norm): on GPUs at the fused router's decode sizes."""
    if not use_triton(x) or x.dim() != 2:
        return False
    from homelab_llm.engine.kernels import moe_router

    return 0 < x.shape[0] <= moe_router.FUSED_MAX_TOKENS


def route_gate_topk_norm(x: torch.Tensor, residual: torch.Tensor | None,
                         norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor,
                         top_k: int, renormalize: bool, shared_gate: torch.Tensor | None = None):
    """(weights, ids, shared gate weight or None, norm(x + residual), x + residual): the
    decoder's norm and the router in one launch where router_norm_route says so
    (kernels/moe_router.route_gate_topk_norm)."""
    from homelab_llm.engine.kernels import moe_router

    return moe_router.route_gate_topk_norm(x, residual, norm_weight, eps, gate_weight, top_k,
                                           renormalize, shared_gate)


def moe_block_queue(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, gate_weight: torch.Tensor, top_k: int, renormalize: bool, w4
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the experts' weighted sum, x + residual) of a pre-norm MoE block without a shared expert
    in one launch (kernels/fused_moe_queue.py) where the device's table or
    HOMELAB_LLM_MOE_QUEUE=1 takes these tokens through w4 (a MoeW4), else None. For calls
    router_norm_route takes (the caller checks it)."""
    from homelab_llm.engine.kernels import fused_moe_queue

    tiles = fused_moe_queue.moe_queue_route(x, w4)
    if tiles is None:
        return None
    got = fused_moe_queue.moe_queue(x, residual, norm_weight, eps, gate_weight, top_k, renormalize,
                                    w4, tiles)
    return got.out, got.summed


def fused_moe(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, b13: torch.Tensor | None = None,
              b2: torch.Tensor | None = None,
              clamp: tuple[float, float] | None = None,
              shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, H] through the picked experts, router-weighted and summed -> [T, H] in x's dtype.
    w13 [E, 2I, H] and w2 [E, H, I], or w13 a kernels.moe_ref.MoeW4 / MoeMx4 and w2 None.
    gpt-oss: expert biases b13 [E, 2I] / b2 [E, H] and clamp = (alpha, limit) for its clamped
    SwiGLU (kernels/moe_gptoss_ref.py). shared: (a shared expert's output [T, H], its gate
    float32 [T]) added in (moe_ref.add_shared_ref; on GPUs at decode sizes inside the combine)."""
    if use_triton(x):
        from homelab_llm.engine.kernels.fused_moe import fused_moe as fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, b13=b13, b2=b2, clamp=clamp,
                                shared=shared)
    if shared is not None:
        from homelab_llm.engine.kernels.moe_ref import add_shared_ref

        return add_shared_ref(fused_moe(x, w13, w2, topk_weights, topk_ids, b13, b2, clamp),
                              *shared)
    if clamp is not None:
        from homelab_llm.engine.kernels.moe_gptoss_ref import gptoss_experts_ref

        return gptoss_experts_ref(x, w13, b13, w2, b2, topk_weights, topk_ids, *clamp)
    from homelab_llm.engine.kernels.moe_ref import moe_experts_ref

    return moe_experts_ref(x, w13, w2, topk_weights, topk_ids)


def sample(logits, temperature, top_k, top_p, min_p, seeds, steps, modes=None) -> torch.Tensor:
    """Token ids [B] int64, on the device, no host sync (see kernels/sampling.py; `modes` is its
    SampleModes, known on the host, so only the needed passes launch). On the CPU the reference
    draws its exponential noise from torch generators seeded per row and step."""
    if use_triton(logits):
        from homelab_llm.engine.kernels import sampling

        return sampling.sample(logits, temperature, top_k, top_p, min_p, seeds, steps, modes=modes)
    if not bool((temperature > 0).any()):  # all greedy: no noise to draw
        with single_thread():  # a few rows: less work than the thread pool's fork/join
            return torch.argmax(logits.float(), dim=-1)
    noise = torch.ones(logits.shape, dtype=torch.float32)
    rows = zip(seeds.tolist(), steps.tolist(), (temperature > 0).tolist())
    for row, (seed, step, draws) in enumerate(rows):
        if draws:
            gen = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(step)) & 0x7FFF_FFFF_FFFF_FFFF)
            noise[row].exponential_(generator=gen)
    return ref.sample_ref(logits, temperature, top_k, top_p, min_p, noise.to(logits.device))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Grammar masks (int32 bits, one row per constrained sequence) onto `logits[rows]`, in place.
    One function on both paths: a gather, a shift and a masked fill, a few kernels on the GPU for
    the handful of constrained rows (ref.apply_token_bitmask_ref)."""
    ref.apply_token_bitmask_ref(logits, upload_pinned(bitmask, logits.device),
                                upload_pinned(rows, logits.device))
