"""Compile every Triton kernel for real GPU targets on a machine without a GPU.

The CPU tests run kernels through TRITON_INTERPRET=1, which accepts code the real compiler rejects
(a reassigned constexpr, a loop-carried variable whose type changes). This module closes that gap
in two steps, each in its own process because `triton.jit` picks the interpreter at import time:

1. capture (TRITON_INTERPRET=1): call every kernel wrapper at model-like shapes with the tuning
   table forced to one arch (sm80, sm90, gfx1100) and the interpreter switches off, so tile sizes,
   num_warps/num_stages and DOT_F32 are what that GPU gets. A patched launch records each launch
   (kernel, args, options) and skips running it.
2. compile (no interpreter): rebuild each distinct launch as a signature + constexprs and hand it
   to `triton.compile` with an explicit GPUTarget; no device needed.

CLI (what the lead runs on a GPU box too):
    python -m tests.engine.kernels.gpu_compile [--targets sm80,sm90,gfx1100] [--jobs N]

CI compiles with the Triton its torch pins; users (and the lent H200s: torch 2.11) run older
ones, whose front end differs (Triton 3.6 rejected an accumulating int32 dot that 3.9 accepts).
Against another version, one target per run (each takes 1-4 minutes on two cores):
    pip install --no-deps --target /tmp/tri36 triton==3.6.0
    PYTHONPATH=/tmp/tri36:$PWD python -m tests.engine.kernels.gpu_compile --targets sm90
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.engine.kernels.compile_known import KNOWN_FILE, compile_key, load_known, write_known

REPO = Path(__file__).resolve().parents[3]
KERNEL_DIR = REPO / "homelab_llm" / "engine" / "kernels"
# target name -> (backend, arch, warp size, tuning-table entry)
TARGETS = {
    "sm80": ("cuda", 80, 32, "sm80"),
    "sm90": ("cuda", 90, 32, "sm90"),
    "gfx1100": ("hip", "gfx1100", 32, "gfx1100"),
}
# Shared memory one program may use: the sm80 entry also serves sm86/sm89 (99 KB opt-in), sm90
# 227 KB, RDNA3 64 KB LDS. The compiler does not check this; the launch would fail on the GPU.
SMEM_LIMIT = {"sm80": 99 * 1024, "sm90": 227 * 1024, "gfx1100": 64 * 1024}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "waves_per_eu", "matrix_instr_nonkdim",
                   "launch_pdl")
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "int8": "i8",
           "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8", "bool": "i1"}


_LAUNCH = re.compile(r"\b(\w+_kernel)\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(")


def launch_sites(text: str) -> list[tuple[str, str]]:
    """(kernel name, the launch's text up to its closing parenthesis) of every `name[grid](...)`
    in a module's source."""
    sites = []
    for m in _LAUNCH.finditer(text):
        depth, end = 0, len(text)
        for i in range(m.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                end = i + 1
                break
        sites.append((m.group(1), text[m.start():end]))
    return sites


def launched_kernels() -> set[str]:
    """'module:name' of every kernel launched as `name[grid](...)` in the kernels package."""
    return {f"homelab_llm.engine.kernels.{path.stem}:{name}"
            for path in sorted(KERNEL_DIR.glob("*.py")) for name, _ in launch_sites(path.read_text())}


# ----------------------------------------------------------------------------------------------
# capture (runs under TRITON_INTERPRET=1)

def _describe(value):
    import torch

    if isinstance(value, torch.Tensor):
        return {"kind": "tensor", "dtype": str(value.dtype).removeprefix("torch."),
                "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, bool):
        return {"kind": "bool", "value": value}
    if isinstance(value, int):
        return {"kind": "int", "value": value}
    if isinstance(value, float):
        return {"kind": "float", "value": value}
    if value is None:
        return {"kind": "none"}
    if isinstance(value, str):  # a constexpr string (a load's eviction policy)
        return {"kind": "str", "value": value}
    if hasattr(value, "value"):  # tl.constexpr
        return _describe(value.value)
    raise TypeError(f"cannot describe a kernel argument of type {type(value).__name__}")


def zero_v(shape: tuple[int, int, int, int], dtype, dim_major: bool = False):
    """A zero V cache [pages, page_size, heads, head_dim]; dim_major: stored dim-major within each
    page (cache/page_pool.KVLayout.v_dim_major, int8 with HOMELAB_LLM_KV_V_LAYOUT=dim)."""
    import torch

    if dim_major:
        pages, page, heads, dim = shape
        return torch.zeros((pages, heads, dim, page), dtype=dtype).permute(0, 3, 1, 2)
    return torch.zeros(shape, dtype=dtype)


# int8 V dim-major or not: the engine runs both (HOMELAB_LLM_KV_V_LAYOUT=dim, on every GPU; its tile
# converts in PTX on NVIDIA)
V_LAYOUTS = (False, True)


@contextlib.contextmanager
def l2_next_on():
    """Launches inside ask the L2 for the next weights (l2_next's budget on, its chains fresh)."""
    from homelab_llm.engine.kernels import l2_next

    saved = os.environ.get(l2_next.ENV)
    os.environ[l2_next.ENV] = "1,4"
    try:
        yield
    finally:
        l2_next.CHAINS.clear()
        if saved is None:
            os.environ.pop(l2_next.ENV)
        else:
            os.environ[l2_next.ENV] = saved


def _scenarios():
    """Wrapper calls at Llama-3.1-8B-like shapes (Hq 32, Hkv 8, D 128, page 16, hidden 4096) that
    reach every launch and every constexpr branch the engine uses. Kernels never run, so sizes
    only matter where a wrapper derives tiles or splits from them."""
    import torch

    from homelab_llm.engine.kernels import (allreduce, decode_attention, elementwise, kv_store,
                                            prefill_attention, sampling, w4a16, w4a16_deq,
                                            w4a16_dot, w4a16_gemv, w4a16_h2, w4a16_mma, w4a16_rows)
    from homelab_llm.engine.kernels import w4a16_pack as wp
    from homelab_llm.engine.kernels.tuning import THIN_N, GemmTiles, RowsTiles, gemm_tiles

    bf16, fp16, i8, i32, i64 = torch.bfloat16, torch.float16, torch.int8, torch.int32, torch.int64
    hq, hkv, d, page, hidden = 32, 8, 128, 16, 4096

    def caches(dtype, pages=64, v_dim_major=False):
        shape = (pages, page, hkv, d)
        if dtype == i8:
            s = torch.ones((pages, page, hkv), dtype=fp16)
            return torch.zeros(shape, dtype=i8), zero_v(shape, i8, v_dim_major), s, s.clone()
        return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), None, None

    for dt in (bf16, fp16):
        x = torch.zeros((4, hidden), dtype=dt)
        w = torch.ones(hidden, dtype=dt)
        yield lambda x=x, w=w: elementwise.rms_norm(x, w, 1e-5)
        yield lambda x=x, w=w: elementwise.add_rms_norm(x, x.clone(), w, 1e-5)
        yield lambda dt=dt: elementwise.qk_norm(torch.zeros((4, 48 * 128), dtype=dt), 32, 8, 128,
                                                torch.ones(128, dtype=dt), torch.ones(128, dtype=dt),
                                                1e-6)
        yield lambda dt=dt: elementwise.silu_and_mul(torch.zeros((4, 2 * 14336), dtype=dt))
        # their outputs in a few-row W4A16 linear's pair order (GemmTiles.x_pairs)
        yield lambda x=x, w=w: elementwise.add_rms_norm(x, x.clone(), w, 1e-5, pair_block=128)
        yield lambda x=x, w=w: elementwise.norm_rows(x, x.clone(), w, 1e-5, 128, keep_k_order=True)
        yield lambda dt=dt: elementwise.silu_and_mul(torch.zeros((4, 2 * 14336), dtype=dt), pair_block=128)
    cos_sin = torch.zeros((256, d), dtype=torch.float32)
    pos = torch.arange(4, dtype=i64)
    q = torch.zeros((4, hq, d), dtype=bf16)
    kv = torch.zeros((4, hkv, d), dtype=bf16)
    yield lambda: elementwise.apply_rope(q, kv, pos, cos_sin)
    slots = torch.arange(4, dtype=i64)
    for cdt, vdm in [(bf16, False)] + [(i8, layout) for layout in V_LAYOUTS]:
        kc, vc, ks, vs = caches(cdt, v_dim_major=vdm)
        yield lambda kc=kc, vc=vc, ks=ks, vs=vs: kv_store.store_kv(kv, kv, kc, vc, slots, ks, vs)
        yield lambda kc=kc, vc=vc, ks=ks, vs=vs: kv_store.rope_store_kv(q, kv, kv, pos, cos_sin, kc, vc, slots, ks, vs)
        # Qwen3's q/k norms inside the same launch, q and k read from the projection
        qkv = torch.zeros((4, (hq + 2 * hkv) * d), dtype=bf16)
        nw = torch.ones(d, dtype=bf16)
        yield lambda kc=kc, vc=vc, ks=ks, vs=vs, qkv=qkv, nw=nw: kv_store.rope_store_kv(
            qkv[:, :hq * d].view(4, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(4, hkv, d),
            kv, pos, cos_sin, kc, vc, slots, ks, vs, qk_norm=(nw, nw, 1e-6))

    batch = 2
    page_table = torch.arange(batch * 32, dtype=i32).reshape(batch, 32)
    seq_lens = torch.tensor([300, 500], dtype=i32)
    qsl_decode = torch.arange(batch + 1, dtype=i32)
    qd = torch.zeros((batch, hq, d), dtype=bf16)
    # None: the table's max_kv_splits; int8 in each V layout the target runs
    for cdt, splits, vdm in [(bf16, 1, False), (bf16, None, False)] + [(i8, None, vd) for vd in V_LAYOUTS]:
        kc, vc, ks, vs = caches(cdt, v_dim_major=vdm)
        for pairs in (0, 128):  # 128: the output in o_proj's pair order (the final store's index)
            yield lambda kc=kc, vc=vc, ks=ks, vs=vs, splits=splits, pairs=pairs: \
                decode_attention.paged_decode_attention(qd, kc, vc, page_table, qsl_decode, seq_lens, 0.088, ks, vs,
                                                        num_splits=splits, max_seq_len=8192, pair_block=pairs)
    # the split kernel's switches (tuning.AttentionTiles) at the arch's tile sizes: int8 score
    # dots, scale and K/V prefetch, fused merge, late q; one split (no merge) too
    from homelab_llm.engine.kernels.tuning import tiles_for
    arch_tiles = tiles_for(None).decode
    on = dict(int8_dot=True, prefetch_scales=True, fused_merge=True)
    for cdt, splits, switches in ((i8, None, on), (i8, None, dict(on, late_q=True)), (i8, 1, dict(on, late_q=True)),
                                  (i8, None, dict(on, prefetch_kv=True, num_stages=1)),
                                  (i8, None, dict(prefetch_scales=True)),
                                  (i8, None, dict(merge_unrotates=False, fused_merge=True)),
                                  (bf16, None, dict(prefetch_kv=True, fused_merge=True, num_stages=1))):
        kc, vc, ks, vs = caches(cdt)
        t = dataclasses.replace(arch_tiles, **switches)
        yield lambda kc=kc, vc=vc, ks=ks, vs=vs, splits=splits, t=t: decode_attention.paged_decode_attention(
            qd, kc, vc, page_table, qsl_decode, seq_lens, 0.088, ks, vs, num_splits=splits, max_seq_len=8192,
            tiles=t)
    # the step's new K/V rotated and stored by the attention itself (new_kv): bf16 and int8
    # caches, the table's tiles and the prefetching ones, with q/k norms read from a projection
    qkv_d = torch.zeros((batch, (hq + 2 * hkv) * d), dtype=bf16)
    q_view = qkv_d[:, :hq * d].view(batch, hq, d)
    k_view = qkv_d[:, hq * d:(hq + hkv) * d].view(batch, hkv, d)
    nw = torch.ones(d, dtype=bf16)
    for cdt, t, norms in ((bf16, None, None), (i8, None, None), (i8, None, (nw, nw, 1e-6)),
                          (bf16, dataclasses.replace(arch_tiles, prefetch_kv=True, fused_merge=True,
                                                     num_stages=1), (nw, nw, 1e-6))):
        kc, vc, ks, vs = caches(cdt)
        new = kv_store.NewKV(k_view, k_view, pos[:batch], cos_sin, slots[:batch], norms)
        yield lambda kc=kc, vc=vc, ks=ks, vs=vs, t=t, new=new: decode_attention.paged_decode_attention(
            q_view, kc, vc, page_table, qsl_decode, seq_lens, 0.088, ks, vs, max_seq_len=8192, tiles=t,
            new_kv=new)
    sinks = torch.zeros(hq, dtype=torch.float32)
    kc, vc, _, _ = caches(bf16)
    for splits in (1, None):  # sliding window + sinks (gpt-oss, Gemma 3 local layers)
        yield lambda kc=kc, vc=vc, splits=splits: decode_attention.paged_decode_attention(
            qd, kc, vc, page_table, qsl_decode, seq_lens, 0.088, num_splits=splits, max_seq_len=8192,
            window=128, sinks=sinks)
    # speculative verify groups: 2 sequences x K+1 = 5 rows, one program per group
    rows = 10
    verify_q = torch.zeros((rows, hq, d), dtype=bf16)
    verify_table = page_table.repeat_interleave(5, dim=0)
    verify_lens = torch.arange(300, 300 + rows, dtype=i32)
    verify_qsl = torch.arange(rows + 1, dtype=i32)
    for cdt, splits in ((bf16, None), (i8, 1)):
        kc, vc, ks, vs = caches(cdt)
        yield lambda kc=kc, vc=vc, ks=ks, vs=vs, splits=splits: decode_attention.paged_decode_attention(
            verify_q, kc, vc, verify_table, verify_qsl, verify_lens, 0.088, ks, vs, num_splits=splits,
            max_seq_len=8192, rows_per_seq=5)
    kc, vc, _, _ = caches(bf16)
    yield lambda kc=kc, vc=vc: decode_attention.paged_decode_attention(
        verify_q, kc, vc, verify_table, verify_qsl, verify_lens, 0.088, max_seq_len=8192, window=128,
        sinks=sinks, rows_per_seq=5)
    # the largest group one program takes (MAX_TILE_ROWS = 16 rows x 4 query heads)
    yield lambda kc=kc, vc=vc: decode_attention.paged_decode_attention(
        torch.zeros((32, hq, d), dtype=bf16), kc, vc, page_table.repeat_interleave(16, dim=0),
        torch.arange(33, dtype=i32), torch.arange(300, 332, dtype=i32), 0.088, max_seq_len=8192, rows_per_seq=16)
    qp = torch.zeros((64, hq, d), dtype=bf16)
    qsl = torch.tensor([0, 24, 64], dtype=i32)
    for cdt, vdm in [(bf16, False)] + [(i8, layout) for layout in V_LAYOUTS]:
        kc, vc, ks, vs = caches(cdt, v_dim_major=vdm)
        yield lambda kc=kc, vc=vc, ks=ks, vs=vs: prefill_attention.paged_prefill_attention(
            qp, kc, vc, page_table, qsl, seq_lens, 0.088, ks, vs, max_query_len=40)
    kc, vc, _, _ = caches(bf16)
    yield lambda kc=kc, vc=vc: prefill_attention.paged_prefill_attention(
        qp, kc, vc, page_table, qsl, seq_lens, 0.088, max_query_len=40, window=128, sinks=sinks)

    vocab = 128256  # the sampler hands over float32 logits
    logits = torch.zeros((batch, vocab), dtype=torch.float32)
    temp, top_p, min_p = torch.tensor([0.0, 0.7]), torch.tensor([1.0, 0.9]), torch.zeros(batch)
    top_k, seeds = torch.tensor([0, 40], dtype=i32), torch.zeros(batch, dtype=i64)
    Modes = sampling.SampleModes
    for m in (Modes(False, False, False), Modes(True, False, False), Modes(True, True, True)):
        yield lambda m=m: sampling.sample(logits, temp, top_k, top_p, min_p, seeds, seeds, modes=m)
    yield lambda: sampling.sample(logits, temp, top_k, top_p, min_p, seeds, seeds,
                                  exponentials=torch.ones((batch, vocab)), modes=Modes(True, True, True))

    k_in, n_out = hidden, 512
    weights = {g: wp.W4Weight(torch.zeros((k_in // 8, n_out), dtype=i32), torch.ones((k_in // g, n_out), dtype=fp16),
                              torch.zeros((k_in // g, n_out), dtype=fp16), g) for g in (32, 128)}
    for m, g, dt in ((1, 128, bf16), (3, 128, bf16), (8, 128, bf16), (1, 32, bf16), (1, 128, fp16),
                     (16, 128, bf16), (48, 128, bf16), (256, 128, bf16), (256, 128, fp16)):
        yield lambda m=m, g=g, dt=dt: w4a16.w4a16_matmul(torch.zeros((m, k_in), dtype=dt), weights[g])
    for g, dt in ((32, bf16), (128, bf16), (128, fp16)):  # prefill: dequantized once for the BLAS GEMM
        yield lambda g=g, dt=dt: w4a16_deq.dequantize_w4(weights[g], dt)
    # the Triton GEMM also where the route table sends prefill rows to dequantize + BLAS (a weight
    # past the scratch cap, archs that keep it): tiles given explicitly pick it
    for m, dt in ((256, bf16), (256, fp16)):
        yield lambda m=m, dt=dt: w4a16.w4a16_matmul(torch.zeros((m, k_in), dtype=dt), weights[128],
                                                    tiles=gemm_tiles(m, None))
    x1 = torch.zeros((1, k_in), dtype=bf16)
    # SPLIT is a constexpr: 1 writes `out` directly, >1 reduces through the tickets
    for split in (1, None):
        yield lambda split=split: w4a16_gemv.w4a16_gemv(x1, weights[128], torch.zeros((1, n_out), dtype=bf16),
                                                        split=split)
    # The multi-row GEMV: each row-count entry of the arch's w4a16_rows table, split 1 and the table's
    for m, g, split in ((1, 128, 1), (1, 128, None), (2, 32, None), (4, 128, None), (8, 128, None),
                        (16, 128, None)):
        x = torch.zeros((m, k_in), dtype=bf16)
        yield lambda x=x, g=g, split=split: w4a16_rows.w4a16_rows(
            x, weights[g], torch.zeros((x.shape[0], n_out), dtype=bf16), split=split)
    # The packed-half GEMV: each row-count entry of the arch's w4a16_h2 table (fp16 too: the
    # prologue converts), split 1 and the table's split; group 32 shrinks the K step; 2048
    # columns: no partial column block (EVEN_N), 512: a partial one.
    wide = wp.W4Weight(torch.zeros((k_in // 8, 2048), dtype=i32), torch.ones((k_in // 128, 2048), dtype=fp16),
                       torch.zeros((k_in // 128, 2048), dtype=fp16), 128)
    for m, w, split, dt in ((1, weights[128], 1, bf16), (1, wide, None, bf16), (2, weights[32], None, bf16),
                            (4, wide, None, bf16), (8, weights[128], None, fp16), (8, wide, None, bf16)):
        x = torch.zeros((m, k_in), dtype=dt)
        yield lambda x=x, w=w, split=split: w4a16_h2.w4a16_h2(
            x, w, torch.zeros((x.shape[0], w.out_features), dtype=bf16), split=split)
    # its prologue forms: RMSNorm with and without the residual add (thin and wide outputs: the
    # fused entries differ past tuning.THIN_N columns), SiLU-and-mul of gate | up
    n_wide = 2 * THIN_N
    wider = wp.W4Weight(torch.zeros((k_in // 8, n_wide), dtype=i32), torch.ones((k_in // 128, n_wide), dtype=fp16),
                        torch.zeros((k_in // 128, n_wide), dtype=fp16), 128)
    for m, res, w in ((1, True, weights[128]), (2, False, weights[128]), (1, True, wider),
                      (2, False, wider)):
        x = torch.zeros((m, k_in), dtype=bf16)
        yield lambda x=x, res=res, w=w: w4a16_h2.w4a16_h2(
            x, w, torch.zeros((x.shape[0], w.out_features), dtype=bf16),
            norm_weight=torch.ones(k_in, dtype=bf16), eps=1e-6,
            residual=torch.zeros_like(x) if res else None, summed=torch.zeros_like(x) if res else None)
    # the normalized rows kept for another linear (Gated DeltaNet's in_proj_ba)
    yield lambda: w4a16_h2.w4a16_h2(
        torch.zeros((1, k_in), dtype=bf16), weights[128], torch.zeros((1, n_out), dtype=bf16),
        norm_weight=torch.ones(k_in, dtype=bf16), eps=1e-6, residual=torch.zeros((1, k_in), dtype=bf16),
        summed=torch.zeros((1, k_in), dtype=bf16), normed=torch.zeros((1, k_in), dtype=bf16))
    for act in ("silu", "gelu_tanh"):
        yield lambda act=act: w4a16_h2.w4a16_h2(torch.zeros((1, 2 * k_in), dtype=bf16), weights[128],
                                                torch.zeros((1, n_out), dtype=bf16), act_in=act)
    # the hand-placed mma.sync kernel (gfx1100 compiles its plain-Triton twin): one program split
    # and several, a partial column tile, fp16 and bf16 activations (the prep launch converts),
    # two and four row tiles (9-16 rows on one-warp programs, 17-32 on four-warp ones; gfx1100's
    # twins of these spill heavily and compile slowly, so one of each)
    for m, w, tiles, dt in ((2, weights[128], w4a16_mma.MmaTiles(2, 2, 1), bf16),
                            (8, wide, w4a16_mma.MmaTiles(1, 4, 4, quads=2), fp16), (5, weights[128], None, bf16),
                            (16, weights[128], w4a16_mma.MmaTiles(1, 1, 1), bf16),
                            (20, wide, w4a16_mma.MmaTiles(1, 4, 4), fp16)):
        x = torch.zeros((m, k_in), dtype=dt)
        yield lambda x=x, w=w, t=tiles: w4a16_mma.w4a16_mma(
            x, w, torch.zeros((x.shape[0], w.out_features), dtype=bf16), t)
    yield lambda: w4a16_mma.prep_pairs(torch.zeros((4, k_in), dtype=bf16), 128)  # its own launch
    # with the norm (residual, kept rows) and the gated activation formed in that launch
    yield lambda: w4a16_mma.prep_pairs(
        torch.zeros((8, k_in), dtype=bf16), 128, norm_weight=torch.ones(k_in, dtype=bf16), eps=1e-6,
        residual=torch.zeros((8, k_in), dtype=bf16), summed=torch.zeros((8, k_in), dtype=bf16),
        normed=torch.zeros((8, k_in), dtype=bf16))
    yield lambda: w4a16_mma.prep_pairs(torch.zeros((3, 2 * k_in), dtype=bf16), 128, act_in="silu")

    # programs over all of K (RowsTiles.whole_k; sm_90 routes the 1-row calls that fit there):
    # 64 columns in 16 lane groups (thin outputs), 128 in 4 (wide ones), 32 in 64 and 32 (outputs
    # of at most 4,096 columns), 64 in 32 (K 6144), every prologue form, a partial column block
    # (n_out + 16 columns) too
    part = wp.W4Weight(torch.zeros((k_in // 8, n_out + 16), dtype=i32),
                       torch.ones((k_in // 128, n_out + 16), dtype=fp16),
                       torch.zeros((k_in // 128, n_out + 16), dtype=fp16), 128)
    for tiles in (RowsTiles(64, 8, 8, prefetch=True, whole_k=True),
                  RowsTiles(128, 8, 4, prefetch=True, whole_k=True),
                  RowsTiles(32, 4, 16, prefetch=True, whole_k=True),
                  RowsTiles(32, 4, 8, prefetch=True, whole_k=True),
                  RowsTiles(64, 8, 16, prefetch=True, whole_k=True)):
        for m, w in ((1, weights[128]), (2, part)):
            x = torch.zeros((m, k_in), dtype=bf16)
            yield lambda x=x, w=w, t=tiles: w4a16_h2.w4a16_h2(
                x, w, torch.zeros((x.shape[0], w.out_features), dtype=bf16), t)
            yield lambda x=x, w=w, t=tiles: w4a16_h2.w4a16_h2(
                x, w, torch.zeros((x.shape[0], w.out_features), dtype=bf16), t,
                norm_weight=torch.ones(k_in, dtype=bf16), eps=1e-6, residual=torch.zeros_like(x),
                summed=torch.zeros_like(x))
        yield lambda t=tiles: w4a16_h2.w4a16_h2(torch.zeros((1, 2 * k_in), dtype=bf16), weights[128],
                                                torch.zeros((1, n_out), dtype=bf16), t, act_in="silu")

    # two steps a lane group: both steps' words requested before the prologue (w4a16_h2.two_steps)
    k_two = 2 * 16 * 64
    two = wp.W4Weight(torch.zeros((k_two // 8, n_out), dtype=i32), torch.ones((k_two // 128, n_out), dtype=fp16),
                      torch.zeros((k_two // 128, n_out), dtype=fp16), 128)
    yield lambda: w4a16_h2.w4a16_h2(torch.zeros((1, k_two), dtype=bf16), two, torch.zeros((1, n_out), dtype=bf16),
                                    RowsTiles(64, 8, 8, prefetch=True, whole_k=True))

    def traced():  # with program_trace's stamps (benchmarks/gemv_trace_gpu.py; PTX targets only)
        from homelab_llm.engine.kernels import program_trace

        program_trace.enable(torch.device("cpu"), rows=4096)
        try:
            w4a16_h2.w4a16_h2(torch.zeros((1, k_in), dtype=bf16), weights[128], torch.zeros((1, n_out), dtype=bf16),
                              norm_weight=torch.ones(k_in, dtype=bf16), eps=1e-6,
                              residual=torch.zeros((1, k_in), dtype=bf16), summed=torch.zeros((1, k_in), dtype=bf16))
        finally:
            program_trace.disable()
    yield traced

    def with_next():  # the tail's L2 requests for the next linear's weights (kernels/l2_next.py)
        with l2_next_on():
            for w, t in ((weights[128], None), (part, None), (weights[128], None),
                         (part, RowsTiles(64, 8, 8, prefetch=True, whole_k=True))):
                w4a16_h2.w4a16_h2(torch.zeros((1, k_in), dtype=bf16), w,
                                  torch.zeros((1, w.out_features), dtype=bf16), t)
    yield with_next
    for m, g, dt in ((8, 32, bf16), (8, 128, bf16), (64, 128, bf16), (8, 128, fp16)):
        # the few-row kernel: per-row and per-step scales (bf16 / fp16 magic-number nibbles), SPLIT 1
        x = torch.zeros((m, k_in), dtype=dt)
        yield lambda x=x, g=g: w4a16_dot.w4a16_dot(x, weights[g], torch.zeros((x.shape[0], n_out), dtype=bf16),
                                                   split=1)
        yield lambda x=x, g=g: w4a16.w4a16_matmul(x, weights[g])
    for m, dt, w in ((40, bf16, weights[128]), (24, fp16, weights[128]), (8, bf16, weights[128]),
                     (8, bf16, wider), (40, bf16, wider), (24, bf16, wider)):
        # the weights as the left operand (route "dotL"; sm_90 routes 3-64 rows there, its tiles
        # differ past tuning.THIN_N columns), every arch compiling it on its own or the w4a16_dot
        # tiles
        x = torch.zeros((m, k_in), dtype=dt)
        yield lambda x=x, w=w: w4a16_dot.w4a16_dot(x, w, torch.zeros((x.shape[0], w.out_features), dtype=bf16),
                                                   split=2, w_left=True)
    for dt in (bf16, fp16):
        # the scaled form (GemmTiles.scaled: sm_90's 17-64-row entries take it by the table above;
        # here on every arch, PTX packed FMAs on NVIDIA, plain arithmetic on RDNA)
        x = torch.zeros((40, k_in), dtype=dt)
        yield lambda x=x: w4a16_dot.w4a16_dot(
            x, wider, torch.zeros((x.shape[0], wider.out_features), dtype=bf16), split=2, w_left=True,
            tiles=GemmTiles(64, 64, 128, num_warps=4, num_stages=2, split_k=4, scaled=True))
    int_zeros = dataclasses.replace(wider, int_zeros=True)
    for m, dt, block_n, warps in ((8, bf16, 128, 8), (8, fp16, 64, 4), (40, bf16, 128, 8)):
        # the integer-zero form (GemmTiles.int_zeros on a W4Weight.int_zeros weight): 16- and
        # 64-row programs, PTX packed adds on NVIDIA, plain arithmetic on RDNA
        x = torch.zeros((m, k_in), dtype=dt)
        yield lambda x=x, t=GemmTiles(64, block_n, 128, num_warps=warps, num_stages=3, split_k=4,
                                      int_zeros=True): w4a16_dot.w4a16_dot(
            x, int_zeros, torch.zeros((x.shape[0], int_zeros.out_features), dtype=bf16), split=2,
            w_left=True, tiles=t)
    for m, dt, block_n, warps, form in ((8, bf16, 128, 8, "pair_accs"), (3, fp16, 64, 4, "pair_accs"),
                                        (40, bf16, 128, 8, "pair_accs"), (8, bf16, 128, 8, "joined"),
                                        (40, fp16, 64, 4, "joined")):
        # one accumulator a nibble pair, or one joined dot a step, over x in pair order
        # (GemmTiles.pair_accs / joined: sm_90 keeps the wgmmas in flight; every arch compiles it)
        x = torch.zeros((m, k_in), dtype=dt)
        yield lambda x=x, t=GemmTiles(64, block_n, 128, num_warps=warps, num_stages=3, split_k=4,
                                      **{form: True}): w4a16_dot.w4a16_dot(
            x, int_zeros, torch.zeros((x.shape[0], int_zeros.out_features), dtype=bf16), split=2,
            w_left=True, tiles=t)
    x = torch.zeros((8, k_in), dtype=bf16)  # the integer-zero form reading x in pair order
    yield lambda x=x: w4a16_dot.w4a16_dot(
        x, int_zeros, torch.zeros((x.shape[0], int_zeros.out_features), dtype=bf16), split=2, w_left=True,
        tiles=GemmTiles(64, 128, 128, num_warps=8, num_stages=3, split_k=4, int_zeros=True), x_paired=True)
    yield from _dot_chain_scenarios(int_zeros)

    yield from _dense_gemv_scenarios()
    yield from _gdn_scenarios()
    yield from _gated_attention_scenarios()
    yield from _moe_scenarios()

    from homelab_llm.engine.parallel.comm import BLOCK as AR_BLOCK, DTYPES as AR_DTYPES, NUM_WARPS as AR_WARPS
    assert set(AR_DTYPES) <= {bf16, fp16, torch.float32}, AR_DTYPES
    for world, dt in ((2, bf16), (8, bf16), (4, fp16), (4, torch.float32)):
        x = torch.zeros(1 << 16, dtype=dt)
        ptrs = torch.zeros(world, dtype=i64)
        yield lambda x=x, ptrs=ptrs, world=world: allreduce.one_shot_all_reduce(
            x, x, ptrs, ptrs, 1 << 20, world - 1, world, 32, AR_BLOCK, AR_WARPS)


def _dense_gemv_scenarios():
    """The bf16/fp16 decode GEMV at the 8B step's shapes: o_proj / down_proj plain (the table's
    split and none), qkv with the norm prologue + residual (and Qwen2's bias), gate_up gated;
    1 and 4 rows; the norm with split K; fp16 at 1 row. torch.empty: the weights are never read."""
    import torch

    from homelab_llm.engine.kernels.dense_gemv import dense_gemv

    hidden, inter = 4096, 14336
    for dt in (torch.bfloat16, torch.float16):
        norm_w = torch.ones(hidden, dtype=dt)
        o_w, down_w = torch.empty((hidden, hidden), dtype=dt), torch.empty((hidden, inter), dtype=dt)
        qkv_w, qkv_b = torch.empty((6144, hidden), dtype=dt), torch.zeros(6144, dtype=dt)
        gate_up_w = torch.empty((2 * inter, hidden), dtype=dt)
        for m in (1, 4) if dt == torch.bfloat16 else (1,):
            x, act = torch.zeros((m, hidden), dtype=dt), torch.zeros((m, inter), dtype=dt)
            yield lambda x=x, w=o_w: dense_gemv(x, w)
            yield lambda x=x, w=o_w: dense_gemv(x, w, split=1)
            yield lambda act=act, w=down_w: dense_gemv(act, w)
            yield lambda x=x, w=qkv_w, nw=norm_w: dense_gemv(x, w, norm_weight=nw, eps=1e-5,
                                                             residual=x.clone())
            yield lambda x=x, w=qkv_w, b=qkv_b, nw=norm_w: dense_gemv(x, w, b, norm_weight=nw,
                                                                      eps=1e-5, residual=x.clone())
            yield lambda x=x, w=gate_up_w, nw=norm_w: dense_gemv(x, w, norm_weight=nw, eps=1e-5,
                                                                 residual=x.clone(), gated=True)
            yield lambda x=x, w=o_w, nw=norm_w: dense_gemv(x, w, norm_weight=nw, eps=1e-5, split=4)
        # Gemma's GELU-tanh-and-mul in the gated epilogue
        yield lambda dt=dt, w=gate_up_w, nw=norm_w: dense_gemv(
            torch.zeros((1, hidden), dtype=dt), w, norm_weight=nw, eps=1e-6,
            residual=torch.zeros((1, hidden), dtype=dt), gated=True, act="gelu_tanh")


# the forms of 4-bit left-operand GEMMs; pair_accs (four accumulators) on 64-row blocks
_W_LEFT_FORMS = ({}, dict(scaled=True), dict(int_zeros=True), dict(pair_accs=True, int_zeros=True, block_m=64),
                 dict(joined=True, int_zeros=True))


def _w_left(gemm, form):
    """MoeGemmTiles with the 4-bit weights as the dots' left operand, in one of its forms."""
    import dataclasses

    from homelab_llm.engine.kernels.tuning import MoeGemmTiles

    tiles = dataclasses.replace(gemm, block_k=max(64, gemm.block_k), w_left=True, **form)
    return MoeGemmTiles(tiles, tiles)


def _moe_scenarios():
    """Fused MoE at the Qwen3-30B-A3B shape (128 experts, top 8, hidden 2048, expert 768; TP=2
    halves the expert width): decode and prefill tiles, bf16 and W4A16 experts."""
    import torch

    from homelab_llm.engine.kernels import fused_moe, moe_align, moe_router
    from homelab_llm.engine.kernels.moe_ref import MoeW4
    from homelab_llm.engine.kernels.tuning import MoeGemmTiles, tiles_for
    from homelab_llm.engine.kernels.w4a16_pack import W4Weight

    e, top_k, hidden = 128, 8, 2048

    def w4(k, n, g=128, int_zeros=False):
        return W4Weight(torch.zeros((e, k // 8, n), dtype=torch.int32),
                        torch.ones((e, k // g, n), dtype=torch.float16),
                        torch.zeros((e, k // g, n), dtype=torch.float16), g, int_zeros=int_zeros)

    inter = 384  # per rank at TP=2; the width is a runtime int, so one size covers TP=1 too
    w13 = torch.zeros((e, 2 * inter, hidden), dtype=torch.bfloat16)
    w2 = torch.zeros((e, hidden, inter), dtype=torch.bfloat16)
    quant = MoeW4(w4(hidden, 2 * inter), w4(inter, hidden))

    def _paired(gemm):
        return MoeGemmTiles(gemm, gemm, paired=True)

    # fused_moe_decode's K splits are constexprs set by K: the TP=1 width (768) splits down's K
    # in 6 where TP=2's splits it in 3
    wide = 768
    for w, w_2 in ((torch.zeros((e, 2 * wide, hidden), dtype=torch.bfloat16),
                    torch.zeros((e, hidden, wide), dtype=torch.bfloat16)),
                   (MoeW4(w4(hidden, 2 * wide), w4(wide, hidden)), None)):
        x, ids = torch.zeros((8, hidden), dtype=torch.bfloat16), torch.zeros((8, top_k), dtype=torch.int32)
        yield lambda x=x, ids=ids, w=w, w_2=w_2: fused_moe.moe_decode(
            x, w, w_2, torch.ones((8, top_k)), ids)
        # Qwen3.5-MoE / Qwen3-Next: the gated shared expert added in the combine
        yield lambda x=x, ids=ids, w=w, w_2=w_2: fused_moe.moe_decode(
            x, w, w_2, torch.ones((8, top_k)), ids, shared=(x, torch.ones(8)))
    # one token's 4-bit experts on the packed-half GEMV (sm_90's moe_h2 tiles, on every target)
    from homelab_llm.engine.kernels.fused_moe_h2 import moe_h2
    from homelab_llm.engine.kernels.tuning import RowsTiles

    h2_tiles = (RowsTiles(32, 4, 8, prefetch=True, whole_k=True),
                RowsTiles(64, 4, 4, prefetch=True, whole_k=True))
    for shared in (None, (torch.zeros((1, hidden), dtype=torch.bfloat16), torch.ones(1))):
        yield lambda shared=shared: moe_h2(
            torch.zeros((1, hidden), dtype=torch.bfloat16), MoeW4(w4(hidden, 2 * wide), w4(wide, hidden)),
            torch.ones((1, top_k)), torch.zeros((1, top_k), dtype=torch.int32), h2_tiles, shared=shared)

    def picked_next():  # gate_up's programs ask the L2 for their picks' down experts (l2_next)
        with l2_next_on():
            moe_h2(torch.zeros((1, hidden), dtype=torch.bfloat16), MoeW4(w4(hidden, 2 * wide), w4(wide, hidden)),
                   torch.ones((1, top_k)), torch.zeros((1, top_k), dtype=torch.int32), h2_tiles)
    yield picked_next
    # the norm, router and both GEMVs in one launch's work queue (sm_90's moe_queue tiles)
    from homelab_llm.engine.kernels.fused_moe_queue import moe_queue
    from homelab_llm.engine.kernels.tuning import QueueTiles

    queue_tiles = QueueTiles(h2_tiles[0], RowsTiles(128, 4, 8, prefetch=True, whole_k=True), 4, hidden)
    # and waits that pause between polls (one token)
    paused = QueueTiles(queue_tiles.up, queue_tiles.down, 4, hidden, poll_pause_ns=500)
    for tokens, tiles in ((1, queue_tiles), (8, queue_tiles), (1, paused)):
        x = torch.zeros((tokens, hidden), dtype=torch.bfloat16)
        yield lambda x=x, tiles=tiles: moe_queue(
            x, x.clone(), torch.ones(hidden, dtype=torch.bfloat16), 1e-6,
            torch.zeros((e, hidden), dtype=torch.bfloat16), top_k, True,
            MoeW4(w4(hidden, 2 * wide), w4(wide, hidden)), tiles)
    for tokens in (1, 8, 2048):  # decode (fused_moe_decode: block_m 1 and 2), prefill
        x = torch.zeros((tokens, hidden), dtype=torch.bfloat16)
        ids = torch.zeros((tokens, top_k), dtype=torch.int32)
        weights = torch.ones((tokens, top_k), dtype=torch.float32)
        yield lambda x=x, ids=ids, weights=weights: fused_moe.fused_moe(x, w13, w2, weights, ids)
        yield lambda x=x, ids=ids, weights=weights: fused_moe.fused_moe(x, quant, None, weights, ids)
        if tokens == 2048:  # gate and up paired in one dot, on every target's prefill tiles
            yield lambda x=x, ids=ids, weights=weights: fused_moe.fused_moe(
                x, w13, w2, weights, ids, tiles=_paired(tiles_for(None).gemm))
            for form in _W_LEFT_FORMS:  # 4-bit weights as the dots' left operand
                q = quant if not form else MoeW4(*(w4(k, n, int_zeros=True) for k, n in
                                                   ((hidden, 2 * inter), (inter, hidden))))
                yield lambda x=x, ids=ids, weights=weights, form=form, q=q: fused_moe.fused_moe(
                    x, q, None, weights, ids, tiles=_w_left(tiles_for(None).gemm, form))
        if tokens <= 8:  # fused above; the tl.dot paths, the older 4-bit GEMV (+ no K splits)
            for w, w_2 in ((w13, w2), (quant, None)):
                yield lambda x=x, ids=ids, weights=weights, w=w, w_2=w_2: fused_moe.fused_moe(
                    x, w, w_2, weights, ids, decode="gemm")
            yield lambda x=x, ids=ids, weights=weights: fused_moe.fused_moe(
                x, quant, None, weights, ids, decode="gemv")
            yield lambda x=x, ids=ids, weights=weights: fused_moe.w4_decode(
                x, quant, weights, ids, split=1)
    yield from _gptoss_moe_scenarios()
    yield lambda: moe_align.moe_align(torch.zeros((4, 10), dtype=torch.int32), 512, 64)
    # Qwen3-MoE's router (128 experts, top 8, bf16 logits) and Qwen3-Next's (512, top 10, unnormalised)
    yield lambda: moe_router.route_topk(torch.zeros((4, e), dtype=torch.bfloat16), top_k, True)
    yield lambda: moe_router.route_topk(torch.zeros((4, 512)), 10, False)
    # the same with the gate matmul fused in (decode sizes, the largest tile at T = 8)
    for tokens in (1, 8):
        x = torch.zeros((tokens, hidden), dtype=torch.bfloat16)
        yield lambda x=x: moe_router.route_gate_topk(
            x, torch.zeros((e, hidden), dtype=torch.bfloat16), top_k, True)
        yield lambda x=x: moe_router.route_gate_topk(
            x, torch.zeros((512, hidden), dtype=torch.bfloat16), 10, False,
            torch.zeros((1, hidden), dtype=torch.bfloat16))
    # the norm in front folded into the router: its RMSNorm prologue (with the residual add),
    # and the variant that writes the normalized rows for the experts (1 and 8 tokens, a shared
    # expert's gate)
    nw = torch.ones(hidden, dtype=torch.bfloat16)
    x = torch.zeros((1, hidden), dtype=torch.bfloat16)
    yield lambda x=x: moe_router.route_gate_topk(
        x, torch.zeros((e, hidden), dtype=torch.bfloat16), top_k, True, norm_weight=nw, eps=1e-6,
        residual=x.clone())
    for tokens in (1, 8):
        x = torch.zeros((tokens, hidden), dtype=torch.bfloat16)
        yield lambda x=x: moe_router.route_gate_topk_norm(
            x, x.clone(), nw, 1e-6, torch.zeros((e, hidden), dtype=torch.bfloat16), top_k, True,
            torch.zeros((1, hidden), dtype=torch.bfloat16))


def _gptoss_moe_scenarios():
    """gpt-oss-20b's experts (32, top 4, hidden and width 2880; TP=2 halves the width): biases and
    the clamped SwiGLU, bf16 and MXFP4 weights, decode (the MXFP4 GEMV) and prefill."""
    import torch

    from homelab_llm.engine.kernels import fused_moe
    from homelab_llm.engine.kernels.moe_ref import MoeMx4, Mx4Weight

    e, top_k, hidden, inter = 32, 4, 2880, 1440

    def mx4(n, k):
        return Mx4Weight(torch.zeros((e, n, k // 2), dtype=torch.uint8),
                         torch.full((e, n, k // 32), 127, dtype=torch.uint8))

    w13 = torch.zeros((e, 2 * inter, hidden), dtype=torch.bfloat16)
    w2 = torch.zeros((e, hidden, inter), dtype=torch.bfloat16)
    b13 = torch.zeros((e, 2 * inter), dtype=torch.bfloat16)
    b2 = torch.zeros((e, hidden), dtype=torch.bfloat16)
    packed = MoeMx4(mx4(2 * inter, hidden), mx4(hidden, inter))
    for tokens in (1, 512):
        x = torch.zeros((tokens, hidden), dtype=torch.bfloat16)
        ids = torch.zeros((tokens, top_k), dtype=torch.int32)
        weights = torch.ones((tokens, top_k), dtype=torch.float32)
        kw = dict(b13=b13, b2=b2, clamp=(1.702, 7.0))
        yield lambda x=x, ids=ids, weights=weights: fused_moe.fused_moe(x, w13, w2, weights, ids, **kw)
        yield lambda x=x, ids=ids, weights=weights: fused_moe.fused_moe(x, packed, None, weights, ids, **kw)


def _gated_attention_scenarios():
    """Qwen3.6-27B's gated attention at decode (24 q heads of 256, each followed by its gate, 4
    kv heads, rotary over the first 64 dims; float32 1 + w norm weights): the q/k norm read past
    the gates, the sigmoid gate read from the projection (alone, and in the decode attention's
    merge), the rotation inside the KV store (bf16 and int8 caches; int8 with the row through
    scratch to the Hadamard butterflies), the int8 decode in the engine's V layout, the prefill
    (int8 and bf16 KV), and Gated
    DeltaNet's in_proj_ba (5120 -> 96) on the one-launch GEMV."""
    import torch

    from homelab_llm.engine.kernels import decode_attention, elementwise, kv_store, prefill_attention
    from homelab_llm.engine.kernels.dense_gemv import dense_gemv

    bf16, i64 = torch.bfloat16, torch.int64
    hq, hkv, d, rd, page = 24, 4, 256, 64, 16
    for m in (1, 4):
        qkv = torch.zeros((m, hq * 2 * d + 2 * hkv * d), dtype=bf16)
        w = torch.ones(d, dtype=torch.float32)
        yield lambda qkv=qkv, w=w: elementwise.qk_norm(qkv, hq, hkv, d, w, w, 1e-6, q_step=2 * d)
        gate = qkv[:, :hq * 2 * d].view(m, hq, 2 * d)[..., d:]
        yield lambda gate=gate, m=m: elementwise.sigmoid_mul(torch.zeros((m, hq * d), dtype=bf16), gate)
        kc, vc = torch.zeros((64, page, hkv, d), dtype=bf16), torch.zeros((64, page, hkv, d), dtype=bf16)
        for splits, pairs in ((None, 0), (None, 128), (1, 128)):  # gate in the merge, or its own launch
            yield lambda gate=gate, m=m, kc=kc, vc=vc, splits=splits, pairs=pairs: \
                decode_attention.paged_decode_attention(
                    torch.zeros((m, hq, d), dtype=bf16), kc, vc,
                    torch.arange(m * 64, dtype=torch.int32).reshape(m, 64) % 64,
                    torch.arange(m + 1, dtype=torch.int32), torch.full((m,), 900, dtype=torch.int32), 0.0625,
                    max_seq_len=4096, gate=gate, num_splits=splits, pair_block=pairs)
        qk = torch.zeros((m, hq + hkv, d), dtype=bf16)
        pos, slots = torch.arange(m, dtype=i64), torch.arange(m, dtype=i64)
        cos_sin = torch.zeros((256, rd), dtype=torch.float32)
        kc, vc = torch.zeros((32, page, hkv, d), dtype=bf16), torch.zeros((32, page, hkv, d), dtype=bf16)
        yield lambda qk=qk, kc=kc, vc=vc, pos=pos, slots=slots, cs=cos_sin: kv_store.rope_store_kv(
            qk[:, :hq], qk[:, hq:], qk[:, hq:], pos, cs, kc, vc, slots)
        # the q/k norms inside it: q read past each head's gate, k from the projection
        q_gated = qkv[:, :hq * 2 * d].view(m, hq, 2 * d)[..., :d]
        k_proj = qkv[:, hq * 2 * d:hq * 2 * d + hkv * d].view(m, hkv, d)
        yield lambda q=q_gated, k=k_proj, kc=kc, vc=vc, pos=pos, slots=slots, cs=cos_sin, w=w: \
            kv_store.rope_store_kv(q, k, k, pos, cs, kc, vc, slots, qk_norm=(w, w, 1e-6))
        # int8 KV with partial rotary: the rotated row through scratch to the butterflies, in
        # the same launch, with and without the q/k norms
        ki, vi = torch.zeros((32, page, hkv, d), dtype=torch.int8), torch.zeros((32, page, hkv, d), dtype=torch.int8)
        sc = torch.ones((32, page, hkv), dtype=torch.float16)
        # the int8 decode the reference deployment runs (int8 KV, o_proj's pair order, the gate
        # in the merge), in each V layout the target runs
        for vd in V_LAYOUTS:
            yield lambda gate=gate, m=m, ki=ki, vi=zero_v(ki.shape, torch.int8, vd), sc=sc: \
                decode_attention.paged_decode_attention(
                    torch.zeros((m, hq, d), dtype=bf16), ki, vi,
                    torch.arange(m * 32, dtype=torch.int32).reshape(m, 32) % 32, torch.arange(m + 1, dtype=torch.int32),
                    torch.full((m,), 400, dtype=torch.int32), 0.0625, sc, sc.clone(), max_seq_len=4096, gate=gate,
                    pair_block=128)
        if m == 1:  # one rank of TP 2 (12 q / 2 KV heads) at 128K: the raised split cap (kv_split_cap)
            k2 = torch.zeros((32, page, hkv // 2, d), dtype=torch.int8)
            s2 = torch.ones((32, page, hkv // 2), dtype=torch.float16)
            for vd in V_LAYOUTS:
                yield lambda gate=gate, k2=k2, v2=zero_v(k2.shape, torch.int8, vd), s2=s2: \
                    decode_attention.paged_decode_attention(
                        torch.zeros((1, hq // 2, d), dtype=bf16), k2, v2, torch.zeros((1, 8192), dtype=torch.int32),
                        torch.arange(2, dtype=torch.int32), torch.full((1,), 131072, dtype=torch.int32), 0.0625,
                        s2, s2.clone(), max_seq_len=131072, gate=gate[:, :hq // 2], pair_block=128)
        for pk, pv, ps in ((ki, vi, sc), (kc, vc, None)) if m == 4 else ():
            # the prefill, int8 and bf16 KV (a 64-token chunk over 400 tokens of context)
            yield lambda pk=pk, pv=pv, ps=ps: prefill_attention.paged_prefill_attention(
                torch.zeros((64, hq, d), dtype=bf16), pk, pv, torch.arange(32, dtype=torch.int32).reshape(1, 32),
                torch.tensor([0, 64], dtype=torch.int32), torch.tensor([400], dtype=torch.int32), 0.0625, ps,
                None if ps is None else ps.clone(), max_query_len=64)
        yield lambda qk=qk, ki=ki, vi=vi, sc=sc, pos=pos, slots=slots, cs=cos_sin: kv_store.rope_store_kv(
            qk[:, :hq], qk[:, hq:], qk[:, hq:], pos, cs, ki, vi, slots, sc, sc.clone())
        yield lambda q=q_gated, k=k_proj, ki=ki, vi=vi, sc=sc, pos=pos, slots=slots, cs=cos_sin, w=w: \
            kv_store.rope_store_kv(q, k, k, pos, cs, ki, vi, slots, sc, sc.clone(), qk_norm=(w, w, 1e-6))
        yield lambda m=m: dense_gemv(torch.zeros((m, 5120), dtype=bf16), torch.empty((96, 5120), dtype=bf16))


def _gdn_scenarios():
    """Gated DeltaNet kernels at Qwen3.6-27B's linear-attention shape (16 key / 48 value heads of
    128, conv over 10240 channels, width 4): a batch of 8 in bf16 with and without conv bias, the
    rule again in fp16 and for one sequence (B_PAD 1). q, k, v are views into the conv output, the
    way the model splits it."""
    import torch

    from homelab_llm.engine.kernels import gdn_chunk, gdn_conv, gdn_norm, gdn_recurrent
    from homelab_llm.engine.kernels.gdn_pending import PendingRows
    from homelab_llm.engine.kernels.w4a16_mma import empty_pairs

    bf16, i32 = torch.bfloat16, torch.int32
    hk, hv, d, channels, width, slots = 16, 48, 128, 10240, 4, 16
    ssm_state = torch.zeros((slots, hv, d, d), dtype=torch.float32)

    def varlen(batch, tokens, dt):
        x = torch.zeros((tokens, channels), dtype=dt)
        q, k, v = x.split([hk * d, hk * d, hv * d], dim=1)
        rule = (q.view(tokens, hk, d), k.view(tokens, hk, d), v.view(tokens, hv, d), torch.zeros((tokens, hv)),
                torch.zeros((tokens, hv), dtype=dt))
        cu = torch.linspace(0, tokens, batch + 1).to(i32)
        return x, rule, cu, torch.arange(batch, dtype=i32), torch.ones(batch, dtype=torch.bool)

    x, rule, cu, idx, init = varlen(8, 4096, bf16)
    conv_state = torch.zeros((slots, width - 1, channels), dtype=bf16)
    weight = torch.zeros((channels, width), dtype=bf16)
    for bias in (None, torch.zeros(channels, dtype=bf16)):
        yield lambda b=bias: gdn_conv.conv1d_prefill(x, weight, b, cu, conv_state, idx, init)
        yield lambda b=bias: gdn_conv.conv1d_decode(x[:8], weight, b, conv_state, idx)
    verify_idx = torch.arange(40, dtype=i32) % slots  # a verify step: 8 sequences x K+1 = 5 rows
    pend = PendingRows.allocate(slots, 5, hk, d, hv, d, channels, bf16, torch.device("cpu"))
    yield lambda: gdn_conv.conv1d_decode(x[:40], weight, None, conv_state, verify_idx, rows_per_seq=5, pending=pend)
    yield lambda: gdn_conv.conv1d_decode(x[:8], weight, None, conv_state, idx, pending=pend)  # after a verify
    yield lambda: gdn_norm.gated_rms_norm(rule[2].reshape(-1, d), rule[2].reshape(-1, d), torch.ones(d, dtype=bf16),
                                          1e-6)
    yield lambda: gdn_norm.gdn_gating(rule[4], rule[4], torch.zeros(hv), torch.zeros(hv))
    for batch, tokens, dt in ((8, 4096, bf16), (8, 4096, torch.float16), (1, 2048, bf16)):
        _, rule, cu, idx, init = varlen(batch, tokens, dt)
        for split in (False, True):  # the fused sequential kernel and the split (state walk + outputs) path
            yield lambda r=rule, cu=cu, idx=idx, init=init, sp=split: gdn_chunk.chunk_gated_delta_rule(
                *r, cu, ssm_state, idx, init, split=sp)
        if batch > 1:
            yield lambda r=rule, idx=idx: gdn_recurrent.recurrent_gated_delta_rule(
                *(t[:idx.shape[0]] for t in r), ssm_state, idx)
            yield lambda r=rule: gdn_recurrent.recurrent_gated_delta_rule(
                *(t[:40] for t in r), ssm_state, verify_idx, rows_per_seq=5, pending=pend)
            # one sequence's verify (5 rows) takes the table's verify tiles
            yield lambda r=rule: gdn_recurrent.recurrent_gated_delta_rule(
                *(t[:5] for t in r), ssm_state, verify_idx[:5], rows_per_seq=5, pending=pend)
            # the gating in the kernel: raw a and b (bf16 / fp16 columns of in_proj_ba's output)
            gates = (torch.zeros(hv), torch.zeros(hv))
            yield lambda r=rule, idx=idx, gates=gates: gdn_recurrent.recurrent_gated_delta_rule(
                *(t[:idx.shape[0]] for t in r[:3]), r[4][:idx.shape[0]], r[4][:idx.shape[0]], ssm_state,
                idx, gating=gates)
            yield lambda r=rule, gates=gates: gdn_recurrent.recurrent_gated_delta_rule(
                *(t[:40] for t in r[:3]), r[4][:40], r[4][:40], ssm_state, verify_idx, rows_per_seq=5,
                gating=gates, pending=pend)
            # and the layer's gated norm by each head's last value-block program
            norm = (torch.ones(d, dtype=dt), 1e-6)
            yield lambda r=rule, idx=idx, gates=gates, norm=norm: gdn_recurrent.recurrent_gated_delta_rule(
                *(t[:idx.shape[0]] for t in r[:3]), r[4][:idx.shape[0]], r[4][:idx.shape[0]], ssm_state,
                idx, gating=gates, gated_norm=(r[2][:idx.shape[0]], *norm))
            yield lambda r=rule, gates=gates, norm=norm: gdn_recurrent.recurrent_gated_delta_rule(
                *(t[:40] for t in r[:3]), r[4][:40], r[4][:40], ssm_state, verify_idx, rows_per_seq=5,
                gating=gates, gated_norm=(r[2][:40], *norm), pending=pend)
            # a plain decode step after verifies: the pending rows replayed as the state loads
            yield lambda r=rule, idx=idx, gates=gates, norm=norm: gdn_recurrent.recurrent_gated_delta_rule(
                *(t[:idx.shape[0]] for t in r[:3]), r[4][:idx.shape[0]], r[4][:idx.shape[0]], ssm_state,
                idx, gating=gates, gated_norm=(r[2][:idx.shape[0]], *norm), pending=pend)
            # the norm writing out_proj's W4A16 mma pairs (a step, a verify)
            for rows, per in ((idx.shape[0], 1), (40, 5)):
                yield lambda r=rule, gates=gates, norm=norm, rows=rows, per=per: \
                    gdn_recurrent.recurrent_gated_delta_rule(
                        *(t[:rows] for t in r[:3]), r[4][:rows], r[4][:rows], ssm_state,
                        verify_idx[:rows] if per > 1 else idx, rows_per_seq=per, gating=gates,
                        gated_norm=(r[2][:rows], *norm), pending=pend if per > 1 else None,
                        mma_pairs=empty_pairs(rows, hv * d, 128, torch.device("cpu")))


def _dot_chain_scenarios(w):
    """The few-row kernel's chained epilogues (kernels/w4a16_epilogue.py) over x in pair order:
    the norm's add after the linear (split 1 and 2), the norm's scale and the act-and-mul after
    it (SiLU, GELU-tanh; the act-and-mul alone too), the norm's scale alone; the table's joined
    form (sm_90) and the integer-zero one, fp16 and bf16."""
    import torch

    from homelab_llm.engine.kernels import w4a16_dot
    from homelab_llm.engine.kernels.tuning import GemmTiles
    from homelab_llm.engine.kernels.w4a16_epilogue import ACT_OUT, NORM_OUT, DotChain

    k, n = w.in_features, w.out_features
    for m, dt, form, every in ((8, torch.bfloat16, "joined", True), (40, torch.float16, "joined", False),
                               (8, torch.bfloat16, "int_zeros", False)):
        tiles = GemmTiles(64, 64, 128, num_warps=4, num_stages=3, split_k=4, **{form: True})
        x = torch.zeros((m, k), dtype=dt)
        rstd = torch.zeros(m, dtype=torch.float32)
        out_rows = torch.zeros((m, n), dtype=dt)
        norm_out = DotChain(NORM_OUT, out_pairs=128, residual=torch.zeros((m, n), dtype=dt),
                            norm_weight=torch.ones(n, dtype=dt), eps=1e-6, summed=torch.zeros((m, n), dtype=dt),
                            y=out_rows, parts=torch.zeros((n // 64, m), dtype=torch.float32), rstd=rstd)
        chains = [DotChain(), norm_out, DotChain(rstd_in=rstd)]  # the plain form beside them
        chains += [DotChain(ACT_OUT, act=act, out_pairs=128, y=torch.zeros((m, n // 2), dtype=dt), rstd_in=r)
                   for act in ("silu", "gelu_tanh") for r in (rstd, None)]  # after a chained norm or its launch
        if not every:  # the other tiles: the norm's add and the act-and-mul after a chained norm
            chains = [norm_out, chains[3]]
        for chain, split in [(norm_out, 1)] + [(c, 2) for c in chains]:
            yield lambda x=x, c=chain, s=split, t=tiles: w4a16_dot.w4a16_dot(
                x, w, out_rows, tiles=t, split=s, w_left=True, x_paired=True, chain=c)


def capture(arch: str) -> list[dict]:
    """Every distinct launch the scenarios make with the tuning table forced to `arch`."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "capture must run under TRITON_INTERPRET=1"
    import importlib
    import pkgutil

    from triton.runtime.interpreter import InterpretedFunction

    import homelab_llm.engine.kernels as pkg
    from homelab_llm.engine.kernels import pdl, tuning

    real_interpreting = tuning.interpreting
    mods = [importlib.import_module(f"{pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)]
    tuning.arch_name = lambda device=None: arch
    for mod in mods:
        if getattr(mod, "interpreting", None) is real_interpreting:
            mod.interpreting = lambda: False
    # the arch's kernels as its GPU launches them: with PDL where its table says so
    pdl.pdl_mode = lambda device: tuning.TABLE[arch].pdl

    specs: dict[str, dict] = {}

    def record(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in _LAUNCH_OPTIONS if k in kwargs}
        names = self.arg_names
        if len(args) > len(names):
            raise TypeError(f"{self.fn.__name__}: too many arguments")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        for name, param in inspect.signature(self.fn).parameters.items():  # defaulted constexprs
            if name not in bound and param.default is not inspect.Parameter.empty:
                bound[name] = param.default
        missing = [n for n in names if n not in bound]
        if missing:
            raise TypeError(f"{self.fn.__name__}: missing arguments {missing}")
        spec = {"kernel": f"{self.fn.__module__}:{self.fn.__name__}",
                "args": {n: _describe(bound[n]) for n in names}, "options": options}
        key = json.dumps(spec, sort_keys=True)
        # Values of non-constexpr ints differ between calls without changing the compiled code;
        # dedupe on the compile-relevant view in the compile step, keep all here (cheap).
        specs.setdefault(key, spec)

    InterpretedFunction.run = record
    for call in _scenarios():
        call()
    return list(specs.values())


# ----------------------------------------------------------------------------------------------
# compile (runs WITHOUT the interpreter)

def _kernel_fn(qualname: str):
    import importlib

    mod, name = qualname.split(":")
    fn = getattr(importlib.import_module(mod), name)
    if not hasattr(fn, "params"):
        raise RuntimeError(f"{qualname} is not a JITFunction (is TRITON_INTERPRET set?)")
    return fn


def to_source_args(fn, spec: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ASTSource, specialised the way the JIT launcher does:
    constexpr params by value, ints equal to 1 as constexpr, 16-divisible ints and 16-aligned
    pointers marked tt.divisibility=16 (which is what enables vectorised loads)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        a = spec["args"][p.name]
        specialize = not getattr(p, "do_not_specialize", False)
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = a.get("value")
        elif a["kind"] == "tensor":
            signature[p.name] = "*" + _DTYPES[a["dtype"]]
            if a["aligned"]:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif a["kind"] == "int":
            v = a["value"]
            if v == 1 and specialize:
                signature[p.name] = "constexpr"
                constexprs[p.name] = 1
                continue
            signature[p.name] = "i32" if -2**31 <= v < 2**31 else ("i64" if v < 2**63 else "u64")
            if specialize and v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif a["kind"] == "float":
            signature[p.name] = "fp32"
        elif a["kind"] == "bool":
            signature[p.name] = "i1"
        elif a["kind"] == "none":
            signature[p.name] = "constexpr"
            constexprs[p.name] = None
        else:
            raise TypeError(f"{p.name}: unknown argument kind {a['kind']}")
    return signature, constexprs, attrs


def _target(name: str):
    from triton.backends.compiler import GPUTarget

    backend, arch, warp, _ = TARGETS[name]
    return GPUTarget(backend, arch, warp)


def resource_usage(kernel, target: str) -> dict:
    """Registers and spills of a compiled kernel, read from its binary (no device needed).
    CUDA: cuobjdump --dump-resource-usage on the cubin (REG; LOCAL + STACK = spilled bytes per thread);
    HIP: the code object's metadata (.vgpr_count, .vgpr_spill_count). {} when unreadable."""
    if TARGETS[target][0] == "hip":
        text = kernel.asm.get("amdgcn", "")
        regs = re.search(r"\.vgpr_count:\s+(\d+)", text)
        spills = re.search(r"\.vgpr_spill_count:\s+(\d+)", text)
        return {"regs": int(regs.group(1)), "spills": int(spills.group(1)) if spills else 0} if regs else {}
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        try:
            out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                                 text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return {}
    # spilled registers land in LOCAL or, with a register cap (maxnreg), in STACK
    regs = re.search(r"REG:(\d+)", out)
    spills = sum(int(m.group(1)) for m in re.finditer(r"(?:LOCAL|STACK):(\d+)", out))
    return {"regs": int(regs.group(1)), "spills": spills} if regs else {}


def _chain(e: BaseException) -> str:
    """The error with its causes (a CompilationError's message points at the call; the cause
    says what failed inside it)."""
    parts = []
    while e is not None and len(parts) < 4:
        parts.append(f"{type(e).__name__}: {e}".strip())
        e = e.__cause__ or e.__context__
    return "\n  caused by ".join(parts)


def source(spec: dict):
    """The ASTSource triton.compile takes for one captured launch."""
    from triton.compiler import ASTSource

    fn = _kernel_fn(spec["kernel"])
    signature, constexprs, attrs = to_source_args(fn, spec)
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def compile_one(spec: dict, target: str, usage: bool = False,
                key: str | None = None) -> tuple[str | None, int] | tuple[str | None, int, dict]:
    """(None when it compiles, else the compiler's message; shared memory bytes it uses), and
    with usage=True the resource_usage dict as a third item. key: compile_known.compile_key's
    for this compile, checked against the hash Triton's cache gave the binary."""
    import triton

    try:
        kernel = triton.compile(source(spec), target=_target(target), options=dict(spec["options"]))
    except Exception as e:  # noqa: BLE001 - every compiler failure is the finding
        return (_chain(e), 0) + (({},) if usage else ())
    shared = getattr(kernel.metadata, "shared", 0) or 0
    err = _smem_problem(shared, target)
    if key is not None and kernel.hash != key and err is None:
        err = (f"Triton cached this compile as {kernel.hash}, compile_known.compile_key gave {key}: "
               "its memo of passed compiles would not find (or would wrongly find) this one")
    return (err, shared) + ((resource_usage(kernel, target),) if usage else ())


def _smem_problem(shared: int, target: str) -> str | None:
    if shared > SMEM_LIMIT[target]:
        return f"OutOfResources: needs {shared} bytes of shared memory, {target} has {SMEM_LIMIT[target]}"
    return None


def toolchain_problem(target: str) -> str | None:
    """Why this triton install cannot compile for `target` at all (missing backend/assembler)."""
    import triton
    import triton.language as tl
    from triton.backends import backends
    from triton.compiler import ASTSource

    backend = TARGETS[target][0]
    key = "nvidia" if backend == "cuda" else "amd"
    if key not in backends:
        return f"triton {triton.__version__} has no {key} backend"

    @triton.jit
    def _probe(x_ptr, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)

    try:
        triton.compile(ASTSource(fn=_probe, signature={"x_ptr": "*fp32", "BLOCK": "constexpr"},
                                 constexprs={"BLOCK": 64}), target=_target(target), options={"num_warps": 1})
    except Exception as e:  # noqa: BLE001
        return f"toolchain for {target} unusable in triton {triton.__version__}: {type(e).__name__}: {e}"[:500]
    return None


def _compile_worker(jobs_file: str, out_file: str, usage: bool = False) -> None:
    jobs = json.loads(Path(jobs_file).read_text())
    results = []
    for target, spec, key in jobs:
        t0 = time.perf_counter()
        err, shared, *rest = compile_one(spec, target, usage, key)
        results.append(_result(target, spec, key, err, shared, round(time.perf_counter() - t0, 2),
                               rest[0] if rest else {}))
    Path(out_file).write_text(json.dumps(results))


def _result(target: str, spec: dict, key: str, error: str | None, shared: int, seconds: float,
            usage: dict, known: bool = False) -> dict:
    return {"target": target, "kernel": spec["kernel"], "options": spec["options"],
            "constexprs": {k: v.get("value") for k, v in spec["args"].items() if v["kind"] != "tensor"},
            "error": error, "shared": shared, "seconds": seconds, "usage": usage, "key": key, "known": known}


def _compile_key(fn, spec: dict) -> str:
    sig, consts, attrs = to_source_args(fn, spec)
    return json.dumps([spec["kernel"], sig, consts, sorted(map(str, attrs.items())), spec["options"]],
                      sort_keys=True, default=str)


# ----------------------------------------------------------------------------------------------
# driver

def _env(interpret: bool, cache_dir: str) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["TRITON_CACHE_DIR"] = cache_dir  # fresh per run: nothing cached across runs
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run(args: list[str], env: dict, timeout: float) -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.engine.kernels.gpu_compile", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"gpu_compile {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def run_all(targets: list[str], jobs: int = 2, timeout: float = 300.0, only: str = "",
            usage: bool = False, every: bool = False, known_file: Path = KNOWN_FILE,
            specs_file: Path | None = None) -> dict:
    """Capture for every target's tuning entry, then compile (kernels whose name contains `only`;
    usage: also read registers/spills) what known_file (compile_known's) does not list as passed
    (every: all of it). Returns {"skipped": {target: reason}, "results": [...], "missing": {target:
    [kernels never launched]}}; a result from the file has "known" true and 0 seconds.
    specs_file: where the capture is kept (one that exists is used instead of capturing again)."""
    with tempfile.TemporaryDirectory(prefix="gpu_compile_") as tmp:
        interp_env, compile_env = _env(True, f"{tmp}/cache_i"), _env(False, f"{tmp}/cache_c")
        specs = str(specs_file or f"{tmp}/specs.json")
        if not Path(specs).exists():
            _run(["_capture", ",".join(targets), specs], interp_env, timeout)
        _run(["_plan", ",".join(targets), specs, f"{tmp}/plan.json", str(jobs), only,
              "" if every or usage else str(known_file)], compile_env, timeout)
        plan = json.loads(Path(f"{tmp}/plan.json").read_text())
        procs = []
        for i, shard in enumerate(plan["shards"]):
            Path(f"{tmp}/jobs{i}.json").write_text(json.dumps(shard))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.engine.kernels.gpu_compile", "_compile", f"{tmp}/jobs{i}.json",
                 f"{tmp}/out{i}.json", "usage" if usage else ""], cwd=REPO, env=compile_env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        results, deadline = [], time.monotonic() + timeout
        for i, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
            if p.returncode:
                raise RuntimeError(f"compile worker {i} crashed:\n{out[-3000:]}")
            results += json.loads(Path(f"{tmp}/out{i}.json").read_text())
    return {"skipped": plan["skipped"], "results": plan["known"] + results, "missing": plan["missing"]}


def _main(argv: list[str]) -> int:
    if argv and argv[0] in ("_capture", "_plan", "_compile"):  # run_all's helpers: gone with their parent
        from tests.engine.kernels.parent_death import die_with_parent

        die_with_parent()
    if argv and argv[0] == "_capture":
        targets, out = argv[1].split(","), argv[2]
        Path(out).write_text(json.dumps({t: capture(TARGETS[t][3]) for t in targets}))
        return 0
    if argv and argv[0] == "_plan":
        targets, specs_file, out, jobs = argv[1].split(","), argv[2], argv[3], int(argv[4])
        only = argv[5] if len(argv) > 5 else ""
        known = load_known(Path(argv[6])) if len(argv) > 6 and argv[6] else {}
        specs = json.loads(Path(specs_file).read_text())
        skipped = {t: r for t in targets if (r := toolchain_problem(t))}
        work, missing, passed = [], {}, []
        expected = launched_kernels()
        for t in targets:
            missing[t] = sorted(expected - {s["kernel"] for s in specs[t]})
            if t in skipped:
                continue
            seen = set()
            for s in specs[t]:
                if only not in s["kernel"]:
                    continue
                key = _compile_key(_kernel_fn(s["kernel"]), s)
                if key in seen:
                    continue
                seen.add(key)
                triton_key = compile_key(source(s), _target(t), s["options"])
                if triton_key in known:  # compiled and passed before, byte for byte the same
                    shared = known[triton_key]
                    passed.append(_result(t, s, triton_key, _smem_problem(shared, t), shared, 0.0, {}, known=True))
                else:
                    work.append((t, s, triton_key))
        # Longest first (big dot tiles), dealt round-robin so shards finish together.
        work.sort(key=lambda w: ("attention" not in w[1]["kernel"] and "w4a16" not in w[1]["kernel"]))
        shards = [work[i::jobs] for i in range(jobs)]
        Path(out).write_text(json.dumps({"shards": shards, "skipped": skipped, "missing": missing,
                                         "known": passed}))
        return 0
    if argv and argv[0] == "_compile":
        _compile_worker(argv[1], argv[2], len(argv) > 3 and argv[3] == "usage")
        return 0

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--kernels", default="", help="compile only kernels whose name contains this")
    ap.add_argument("--regs", action="store_true", help="print registers/spills of each compile")
    ap.add_argument("--timeout", type=float, default=4000.0, help="seconds for the whole run")
    ap.add_argument("--all", action="store_true", help="compile the launches known to pass too")
    ap.add_argument("--write-known", action="store_true",
                    help="compile everything, then record what passed (compile_known.KNOWN_FILE)")
    a = ap.parse_args(argv)
    if a.write_known and (a.kernels or a.targets != ",".join(TARGETS)):
        print("--write-known needs every kernel and target (no --kernels, --targets)")
        return 2
    t0 = time.perf_counter()
    report = run_all(a.targets.split(","), a.jobs, a.timeout, only=a.kernels, usage=a.regs,
                     every=a.all or a.write_known)
    bad = [r for r in report["results"] if r["error"]]
    for t, why in report["skipped"].items():
        print(f"SKIP {t}: {why}")
    for t, names in report["missing"].items():
        if names:
            print(f"NOT COVERED {t}: {names}")
    per = {}
    for r in report["results"]:
        p = per.setdefault(r["target"], [0, 0.0, 0, ""])
        p[0] += 1
        p[1] += r["seconds"]
        if r["shared"] > p[2]:
            p[2:] = [r["shared"], r["kernel"].split(":")[1]]
    for t, (n, s, smem, who) in per.items():
        print(f"{t}: {n} compiles, {s:.1f} s compiler time, max shared {smem} B ({who}) of {SMEM_LIMIT[t]}")
    if a.regs:
        for r in sorted(report["results"], key=lambda r: (r["kernel"], r["target"])):
            u = r["usage"]
            consts = {k: v for k, v in r["constexprs"].items() if k.isupper()}
            print(f"{r['target']:8s} {r['kernel'].split(':')[1]:28s} regs {u.get('regs', '?'):>4} "
                  f"spills {u.get('spills', '?'):>4} warps {r['options'].get('num_warps')} {consts}")
    for r in bad:
        print(f"FAIL {r['kernel']} [{r['target']}] options={r['options']}\n  {r['error'][:1500]}")
    known = sum(r["known"] for r in report["results"])
    print(f"{len(report['results'])} compiles ({known} known to pass: not compiled), {len(bad)} failures, "
          f"{time.perf_counter() - t0:.1f} s wall")
    if a.write_known:
        print(f"{write_known(report['results'])} passed compiles written to {KNOWN_FILE}")
    return 1 if bad or any(report["missing"].values()) else 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
