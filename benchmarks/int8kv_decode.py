"""Paged decode attention over long contexts, int8 vs bf16 KV: the split kernel's variants side by
side with the kernel as it was, against the copy rate of the same bytes (H200, issue 19).

    python3 benchmarks/int8kv_decode.py [--quick] [--ctx 1024,4096,16384,65536] [--batch 1,8]
        [--many 64] [--variants old,sc.dot,...] [--splits table,N,...] [--jobs N]

Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head_dim 128, page 16; --shape 27b:
Qwen3.6-27B's full-attention layers, 24 / 4 / 256; 27b-tp2: one rank's 12 / 2 / 256 at TP 2),
one query token per sequence, every sequence ctx tokens long, pages scattered through the pool
(--pages in-order: consecutive). Each call runs in a CUDA graph that cycles through enough copies
of the caches to overflow the L2 (gpu_timing.py), so K/V come from HBM as in a decode step. Per
(KV dtype, context, batch) it prints each variant's microseconds per layer (split kernel + merge)
and the % of the copy rate: the bytes of K + V (+ int8 scales) over the time, against a
device-to-device copy of the same byte count timed the same way in the same run (read + write,
gpu_timing.copy_rate_gbs). Then the max |error| of every variant against paged_attention_ref
(fp32) at full shape, and per dtype the fastest variant per cell with its speedup over "old".

Variants (tuning.AttentionTiles; "b64w4s3" = block_n 64, 4 warps, 3 stages): "old" is the sm_90
table entry before issue 19 (b64w4s3, switches off, every split un-rotating its own partial: the
kernel as it was, except that the merge kernel now issues its lse and partial loads together);
"b64w4s3" the same tiles with the merge un-rotating once per output (int8); "table" this
device's current entry when it differs from "old".
Switch names: sc = prefetch_scales and dot = int8_dot (int8 only), kv = prefetch_kv (num_stages
1), fm = fused_merge, rN = max_regs N (NVIDIA only); a ".vd" suffix runs the variant over a V
cache stored dim-major within each page (the engine's int8 layout on NVIDIA; the same values).
The winners go into tuning.TABLE["sm90"]: the bf16 one as `decode`, the int8 one as
`decode_int8` (the summary prints both as Python).
"table" takes tuning.decode_tiles for the cell (head size and batch: sm_90's int8 tiles for heads
past 128 change from 2 sequences on; sc.dot.b128w4s5.vd is its one-sequence int8 entry).
Splits: "table" = what paged_decode_attention picks for the batch without a length
(choose_num_splits); "engine" = what the engine's decode graphs give it (a server of 128K
context; on sm_90 they differ from batch 2 on for the 8B, 4 for the 27B: the tile picks must
hold at the engine's, BENCHMARKS 58.3); numbers: fixed split counts (powers of two); at batch 1
a few variants also at --b1-splits (rows "name/sN"). --many B adds 1K and 4K contexts at batch B
(a full server's decode batch: the variants must not slow it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import copies_for, copy_rate_gbs, default_jobs, graph_ms, precompile  # noqa: E402
from homelab_llm.engine.kernels.decode_attention import choose_num_splits, paged_decode_attention  # noqa: E402
from homelab_llm.engine.kernels.ref import paged_attention_ref  # noqa: E402
from homelab_llm.engine.cuda_graphs import graph_kv_splits, kv_row_programs, kv_splits_at  # noqa: E402
from homelab_llm.engine.kernels.tuning import AttentionTiles, decode_tiles  # noqa: E402

# attention shapes (q heads, KV heads, head_dim): Llama-3.1-8B's, and Qwen3.6-27B's full-attention
# layers at TP 1 and on one rank of TP 2 (the reference deployment: 2 KV heads a card, so a
# batch-1 call at the table's 32 splits is 64 programs); INT8KV_SHAPE carries --shape into the
# compile workers
SHAPES = {"8b": (32, 8, 128), "27b": (24, 4, 256), "27b-tp2": (12, 2, 256)}
HQ, HKV, D = SHAPES[os.environ.get("INT8KV_SHAPE", "8b")]
PAGE = 16
# "scattered": each sequence's pages in shuffled order through the pool (a server whose free list
# has been churned); "in-order": consecutive pages, as a fresh engine hands a new sequence
PAGES = "scattered"
T = AttentionTiles
I8, BF, BOTH = ("int8",), ("bf16",), ("int8", "bf16")
# name -> (tiles or None for the device's table entry, KV dtypes it applies to). sm_90 compiles
# (regs per thread / spilled bytes, counted with STACK / programs per SM; SASS instructions per KB
# of KV in the loop): int8 old 182/0/2, b64w4s3 155/0/3, 255/KB; sc.dot 181/0/2, 198/KB; sc.dot.s5 146/0/3;
# .r128 128/32/4 (6 spill ops in the loop); sc.dot.w8s5 107/0/2 (8 warps); .r80 80/104/3 (21 in the
# loop); sc.dot.b128w4s5 204/0/2, 137/KB; lq (late_q) raises registers (s5.lq 188) since the q
# preparation sits in the loop. bf16 old 124/0/4, 68/KB; fm 146/0/3; w8s5 84/0/3 (72 KB shared);
# w8s5.fm.r84 79/0/3. s5 = two K/V buffers in flight (the pipeliner keeps one at s3-s4: the
# page-table load takes a stage).
VARIANTS: dict[str, tuple[AttentionTiles | None, tuple[str, ...]]] = {
    "old": (T(64, 4, 3, merge_unrotates=False), BOTH),
    "table": (None, BOTH),
    "b64w4s3": (T(64, 4, 3), I8),
    "old.r128": (T(64, 4, 3, max_regs=128), I8),
    "fm": (T(64, 4, 3, fused_merge=True), BOTH),
    "s5": (T(64, 4, 5), BOTH),
    "w8s5": (T(64, 8, 5), BF),
    "w8s5.fm.r84": (T(64, 8, 5, fused_merge=True, max_regs=84), BF),
    "b128w8s5": (T(128, 8, 5), BF),
    "b128w4s3": (T(128, 4, 3), BF),
    "kv.w8": (T(64, 8, 1, prefetch_kv=True), BF),
    # short contexts (a few hundred keys a split: one or two tiles a program)
    "b32w4s2": (T(32, 4, 2), BF),
    "b32w2s3": (T(32, 2, 3), BF),
    "b64w4s2": (T(64, 4, 2), BF),
    "b128w4s2": (T(128, 4, 2), BF),
    "w8s5.fm": (T(64, 8, 5, fused_merge=True), BF),
    "b128w8s3.fm": (T(128, 8, 3, fused_merge=True), BF),
    "sc": (T(64, 4, 3, prefetch_scales=True), I8),
    "sc.dot": (T(64, 4, 3, int8_dot=True, prefetch_scales=True), I8),
    "sc.dot.r160": (T(64, 4, 3, int8_dot=True, prefetch_scales=True, max_regs=160), I8),
    "sc.dot.s5": (T(64, 4, 5, int8_dot=True, prefetch_scales=True), I8),
    "sc.dot.s5.r128": (T(64, 4, 5, int8_dot=True, prefetch_scales=True, max_regs=128), I8),
    "sc.dot.s5.lq": (T(64, 4, 5, int8_dot=True, prefetch_scales=True, late_q=True), I8),
    "sc.dot.s5.lq.r168": (T(64, 4, 5, int8_dot=True, prefetch_scales=True, late_q=True, max_regs=168), I8),
    "sc.dot.w8s5": (T(64, 8, 5, int8_dot=True, prefetch_scales=True), I8),
    "sc.dot.w8s5.r80": (T(64, 8, 5, int8_dot=True, prefetch_scales=True, max_regs=80), I8),
    "sc.dot.w8s5.lq.r128": (T(64, 8, 5, int8_dot=True, prefetch_scales=True, late_q=True, max_regs=128), I8),
    "sc.dot.w8s5.fm": (T(64, 8, 5, int8_dot=True, prefetch_scales=True, fused_merge=True), I8),
    "sc.dot.b128w4s5": (T(128, 4, 5, int8_dot=True, prefetch_scales=True), I8),
    "sc.dot.b128w8s5.r128": (T(128, 8, 5, int8_dot=True, prefetch_scales=True, max_regs=128), I8),
    "sc.dot.kv.w8": (T(64, 8, 1, int8_dot=True, prefetch_scales=True, prefetch_kv=True), I8),
    # fewer stages (less shared memory a program: more programs an SM) and wider tiles, for
    # batch 1 at long contexts with more splits
    "sc.dot.b128w4s3": (T(128, 4, 3, int8_dot=True, prefetch_scales=True), I8),
    "sc.dot.b128w4s2": (T(128, 4, 2, int8_dot=True, prefetch_scales=True), I8),
    "sc.dot.b128w8s3": (T(128, 8, 3, int8_dot=True, prefetch_scales=True), I8),
    "sc.dot.b256w8s3": (T(256, 8, 3, int8_dot=True, prefetch_scales=True), I8),
    "sc.dot.b64w2s4": (T(64, 2, 4, int8_dot=True, prefetch_scales=True), I8),
    "sc.dot.b128w4s5.fm": (T(128, 4, 5, int8_dot=True, prefetch_scales=True, fused_merge=True), I8),
    "sc.dot.b64w8s4": (T(64, 8, 4, int8_dot=True, prefetch_scales=True), I8),
    "sc.dot.b128w8s5": (T(128, 8, 5, int8_dot=True, prefetch_scales=True), I8),
    "sc.dot.b256w4s3": (T(256, 4, 3, int8_dot=True, prefetch_scales=True), I8),
    "sc.dot.s5.fm": (T(64, 4, 5, int8_dot=True, prefetch_scales=True, fused_merge=True), I8),
}
# ".vd": the same tiles over a V cache stored dim-major within each page (the engine's int8 layout
# on NVIDIA, cache/page_pool.KVLayout.v_dim_major; without ".vd": token-major, as
# HOMELAB_LLM_KV_V_LAYOUT=token and ROCm store it)
VARIANTS.update({f"{name}.vd": VARIANTS[name] for name in (
    "table", "sc.dot", "sc.dot.s5", "sc.dot.b128w4s3", "sc.dot.b128w4s2", "sc.dot.b128w8s3", "sc.dot.b64w8s4",
    "sc.dot.b128w4s5", "sc.dot.b128w4s5.fm", "sc.dot.w8s5", "sc.dot.b256w8s3", "sc.dot.b64w2s4", "sc.dot.b128w8s5",
    "sc.dot.b256w4s3", "sc.dot.s5.fm")})
QUICK = ("old", "table", "fm", "s5", "w8s5", "w8s5.fm.r84", "sc", "sc.dot", "sc.dot.s5", "sc.dot.s5.r128",
         "sc.dot.w8s5", "sc.dot.w8s5.lq.r128", "sc.dot.b128w4s5")
DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8}
DEVICE = "cuda"  # a dry run of the script's logic sets "cpu" under TRITON_INTERPRET=1


def device() -> torch.device:
    return torch.device(DEVICE)


def dim_v(name: str) -> bool:
    """Whether a variant ('name' or 'name/sN') reads a dim-major V cache."""
    return name.split("/")[0].endswith(".vd")


def make_cache(ctx: int, batch: int, dtype: torch.dtype, gen: torch.Generator, dev: torch.device,
               v_dim_major: bool = False):
    """(k, v, k_scale, v_scale, page_table, nbytes) for `batch` sequences of ctx tokens."""
    per_seq = -(-ctx // PAGE)
    pages = per_seq * batch + 1
    shape = (pages, PAGE, HKV, D)
    if dtype == torch.int8:
        k = torch.randint(-127, 128, shape, generator=gen, device=dev, dtype=torch.int8)
        v = torch.randint(-127, 128, shape, generator=gen, device=dev, dtype=torch.int8)
        ks = (torch.rand(pages, PAGE, HKV, generator=gen, device=dev) * 0.02 + 0.01).half()
        vs = (torch.rand(pages, PAGE, HKV, generator=gen, device=dev) * 0.02 + 0.01).half()
    else:
        k = torch.randn(shape, generator=gen, device=dev).to(dtype)
        v = torch.randn(shape, generator=gen, device=dev).to(dtype)
        ks = vs = None
    if v_dim_major:  # the same values, stored [pages, heads, head_dim, page] (PagePool's layout)
        v = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    perm = (torch.randperm(pages, generator=gen, device=dev) if PAGES == "scattered"
            else torch.arange(pages, device=dev)).to(torch.int32)
    table = perm[: per_seq * batch].view(batch, per_seq)
    return k, v, ks, vs, table, kv_bytes(ctx, batch, dtype)


def kv_bytes(ctx: int, batch: int, dtype: torch.dtype) -> int:
    """Bytes one call reads: K + V rows (+ their fp16 scales for int8)."""
    row = D + 2 if dtype == torch.int8 else D * dtype.itemsize
    return 2 * batch * ctx * HKV * row


@dataclass(frozen=True)
class SplitPlan:
    """Split counts per cell: `spec` ("table" and/or numbers) for every variant, plus at batch 1
    the counts `extra` for the variants `extra_names` (wave quantization: 8 KV heads x 64 splits
    = 512 programs against 2-4 resident per SM on 132 SMs)."""

    spec: str = "table"
    extra: tuple[int, ...] = ()
    extra_names: tuple[str, ...] = ()


def split_counts(batch: int, spec: str) -> list[int]:
    """The split counts `spec` names at a batch size ("table", "engine" or numbers)."""
    named = {"table": choose_num_splits(batch, HKV, device()), "engine": engine_splits(batch)}
    return sorted({named[s] if s in named else int(s) for s in spec.split(",")})


def engine_splits(batch: int, max_model_len: int = 131072) -> int:
    """The split count the engine's decode graphs give `batch` one-token rows past short contexts
    (runner.install_graphs: graph_kv_splits, then kv_splits_at over the arch's programs a row),
    for a server started with max_model_len."""
    dev = device()
    return kv_splits_at(graph_kv_splits(dev, HKV, max_model_len, PAGE), batch, kv_row_programs(dev, HKV))


def same_kernel(a: AttentionTiles, b: AttentionTiles, label: str) -> bool:
    """Whether two tiles run the same kernel on this KV dtype (bf16 ignores the int8 switches)."""
    if label == "bf16":
        a, b = (replace(t, int8_dot=False, prefetch_scales=False, merge_unrotates=True) for t in (a, b))
    return a == b


def cell_variants(label: str, names: list[str], batch: int, plan: SplitPlan) -> dict[str, tuple]:
    """'name' or 'name/sN' -> (tiles or None, num_splits) for one dtype and batch."""
    counts = split_counts(batch, plan.spec)
    out = {}
    for name in names:
        tiles, kinds = VARIANTS[name]
        table = decode_tiles(device(), label == "int8", D, batch)
        if name == "table" and any(same_kernel(table, VARIANTS[n][0], label)
                                   for n in names if n != "table" and not dim_v(n) and label in VARIANTS[n][1]):
            continue  # another row already times the table's tiles
        if label not in kinds:
            continue
        extra = [s for s in plan.extra if s not in counts] if batch == 1 and name in plan.extra_names else []
        for s in counts + extra:
            out[name if len(counts) == 1 and s in counts else f"{name}/s{s}"] = (tiles, s)
    return out


def inputs(ctx: int, batch: int, label: str, copies: int, dev: torch.device, v_dim_major: bool = False):
    gen = torch.Generator(device=dev)
    gen.manual_seed(ctx * 16 + batch)
    caches = [make_cache(ctx, batch, DTYPES[label], gen, dev, v_dim_major) for _ in range(copies)]
    q = torch.randn(batch, HQ, D, generator=gen, device=dev).to(torch.bfloat16)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    return caches, q, qsl, sl


def call(caches, i, q, qsl, sl, tiles, splits, out=None):
    k, v, ks, vs, table, _ = caches[i]
    return paged_decode_attention(q, k, v, table, qsl, sl, D ** -0.5, ks, vs, num_splits=splits, out=out,
                                  tiles=tiles)


def compile_task(label: str, batch: int, name: str, splits: SplitPlan) -> None:
    """Precompile worker: one call of one variant on a short cache (the compiled kernel does not
    depend on the length or the batch beyond the split count)."""
    dev = device()
    tiles, s = cell_variants(label, [name.split("/")[0]], batch, splits)[name]
    caches, q, qsl, sl = inputs(256, batch, label, 1, dev, dim_v(name))
    call(caches, 0, q, qsl, sl, tiles, s)
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def bench_cell(ctx: int, batch: int, label: str, names: list[str], splits: SplitPlan) -> tuple[dict, int]:
    dev = device()
    nbytes = kv_bytes(ctx, batch, DTYPES[label])
    copies = copies_for(nbytes, cap=32)
    variants = cell_variants(label, names, batch, splits)
    layouts = {vd: inputs(ctx, batch, label, copies, dev, vd) for vd in sorted({dim_v(n) for n in variants})}
    out = torch.empty(batch, HQ, D, dtype=torch.bfloat16, device=dev)
    res = {}
    for name, (tiles, s) in variants.items():
        caches, q, qsl, sl = layouts[dim_v(name)]
        try:
            res[name] = graph_ms(lambda i, t=tiles, s=s, c=caches: call(c, i, q, qsl, sl, t, s, out), copies)
        except Exception as exc:  # a variant that fails is reported, not fatal
            print(f"  {label} ctx {ctx} b{batch} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return res, nbytes


def error_check(label: str, names: list[str], splits: SplitPlan, ctx: int, batch: int) -> dict[str, float]:
    """max |variant - paged_attention_ref| (fp32 reference) at full shape."""
    dev = device()
    caches, q, qsl, sl = inputs(ctx, batch, label, 1, dev)
    k, v, ks, vs, table, _ = caches[0]
    kf = k if label == "int8" else k.float()
    vf = v if label == "int8" else v.float()
    want = paged_attention_ref(q.float(), kf, vf, table, qsl, sl, D ** -0.5, ks, vs)
    errs = {}
    for name, (tiles, s) in cell_variants(label, names, batch, splits).items():
        # a dim-major V holds the same values (the same seed)
        c = inputs(ctx, batch, label, 1, dev, True)[0] if dim_v(name) else caches
        try:
            errs[name] = (call(c, 0, q, qsl, sl, tiles, s).float() - want).abs().max().item()
        except Exception as exc:  # noqa: BLE001
            errs[name] = float("nan")
            print(f"  error check {label} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    return errs


def cell_name(ctx: int, batch: int) -> str:
    return f"{ctx // 1024 if ctx % 1024 == 0 else ctx}{'K' if ctx % 1024 == 0 else ''} b{batch}"


def old_of(name: str) -> str:
    """The "old" row a variant compares with: the same split count."""
    return "old" + name[len(name.split("/")[0]):]


def long_pick(table: dict, label: str, cells: list[tuple[int, int]]) -> str:
    """The variant with the least summed time over the long-context cells, as its tiles (Python,
    for tuning.TABLE), with its worst slowdown against "old" over every cell (short ones too)."""
    long = [(c, b) for c, b in cells if c >= 4096 and b <= 8]
    totals: dict[str, float] = {}
    for c, b in long:
        for n, (ms, _) in table[(label, c, b)][0].items():
            totals[n] = totals.get(n, 0.0) + ms
    full = {n: t for n, t in totals.items() if all(n in table[(label, c, b)][0] for c, b in long)}
    if not full:
        return "none"
    name = min(full, key=full.get)
    ref = old_of(name)
    worst = max(((table[(label, c, b)][0][name][0] / table[(label, c, b)][0][ref][0], cell_name(c, b))
                 for c, b in cells if name in table[(label, c, b)][0] and ref in table[(label, c, b)][0]),
                default=(float("nan"), "-"))
    tiles = VARIANTS[name.split("/")[0]][0]
    return f"{name} = {tiles!r} (worst cell vs old: {worst[0]:.2f}x at {worst[1]})"


def print_tables(table: dict, cells: list[tuple[int, int]]) -> None:
    """Per KV dtype: variants x cells (us per layer, % of the copy rate), the best per cell, the pick."""
    width = max(len(n) for n in VARIANTS) + 6
    for label in DTYPES:
        rows = sorted({n for (lb, _, _), (r, _) in table.items() if lb == label for n in r},
                      key=lambda n: (list(VARIANTS).index(n.split("/")[0]), len(n), n))
        print(f"\n{label} KV: us per layer (% of the copy rate of its bytes)")
        print(f"{'variant':{width}s}" + "".join(f"{cell_name(c, b):>16s}" for c, b in cells))
        for n in rows:
            line = f"{n:{width}s}"
            for c, b in cells:
                r = table[(label, c, b)][0].get(n)
                line += f"{'-':>16s}" if r is None else f"{f'{r[0] * 1e3:7.1f} ({r[1]:3.0f}%)':>16s}"
            print(line)
        best = []
        for c, b in cells:
            r = table[(label, c, b)][0]
            if r:
                name, (ms, pct) = min(r.items(), key=lambda kv: kv[1][0])
                old = r.get(old_of(name), (float("nan"),))[0]
                best.append(f"{cell_name(c, b)}: {name} {ms * 1e3:.1f}us {pct:.0f}% (old/best {old / ms:.2f}x)")
        print("best: " + " | ".join(best))
        print(f"{label} long-context pick (least total time over the cells >= 4K at batch <= 8): "
              + long_pick(table, label, cells))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"only {','.join(QUICK)}, contexts 4K and 16K")
    p.add_argument("--ctx", default="1024,4096,16384,65536")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--many", type=int, default=64, help="batch of the extra 1K/4K cells (0: none)")
    p.add_argument("--variants", default="", help=f"comma list of {','.join(VARIANTS)}")
    p.add_argument("--splits", default="table",
                   help="'table', 'engine' and/or split counts, comma separated")
    p.add_argument("--b1-splits", default="32,128", help="more split counts at batch 1 for --b1-variants")
    p.add_argument("--b1-variants", default="old,s5,w8s5,sc.dot.s5,sc.dot.w8s5,sc.dot.b128w4s5",
                   help="the variants also timed at --b1-splits")
    p.add_argument("--check", default="16384x1,4096x8", help="CTXxBATCH cells of the max-error check")
    p.add_argument("--jobs", type=int, default=max(default_jobs(), min(16, (os.cpu_count() or 2) - 1)),
                   help="processes that compile first (1: none)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="the attention shape")
    p.add_argument("--pages", choices=("scattered", "in-order"), default="scattered",
                   help="the caches' page order (the engine's graphs read a new sequence's pages in order)")
    a = p.parse_args()
    global HQ, HKV, D, PAGES
    HQ, HKV, D = SHAPES[a.shape]
    PAGES = a.pages
    os.environ["INT8KV_SHAPE"] = a.shape  # the compile workers (spawned) read it at import
    plan = SplitPlan(a.splits, tuple(int(x) for x in a.b1_splits.split(",") if x),
                     tuple(n for n in a.b1_variants.split(",") if n))
    dev = device()
    t0 = time.perf_counter()
    names = a.variants.split(",") if a.variants else list(QUICK if a.quick else VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {','.join(VARIANTS)}")
    ctxs = [4096, 16384] if a.quick and a.ctx == p.get_default("ctx") else [int(c) for c in a.ctx.split(",")]
    batches = [int(b) for b in a.batch.split(",")]
    cells = [(ctx, b) for ctx in ctxs for b in batches]
    cells += [(ctx, a.many) for ctx in (1024, 4096) if a.many and (ctx, a.many) not in cells]
    name = torch.cuda.get_device_name(dev) if DEVICE == "cuda" else DEVICE
    print(f"{name}: table decode tiles bf16 {decode_tiles(dev, False)}, int8 "
          f"{decode_tiles(dev, True)}; splits " + ", ".join(f"b{b} {split_counts(b, plan.spec)}" for b in
                                                            sorted({b for _, b in cells})), flush=True)
    tasks = {(label, str(tiles), s): (label, b, n, plan) for label in DTYPES for b in sorted({b for _, b in cells})
             for n, (tiles, s) in cell_variants(label, names, b, plan).items()}  # distinct compiles
    secs = precompile(compile_task, list(tasks.values()), a.jobs)
    print(f"[{time.perf_counter() - t0:4.0f}s] compiled {len(tasks)} launches in {a.jobs} processes ({secs:.0f} s)",
          flush=True)
    table: dict[tuple[str, int, int], tuple[dict, float]] = {}
    for label in DTYPES:
        for ctx, b in cells:
            res, nbytes = bench_cell(ctx, b, label, names, plan)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            copy = copy_rate_gbs(dev, nbytes)
            table[(label, ctx, b)] = ({n: (ms, 100 * nbytes / ms / 1e6 / copy) for n, ms in res.items()}, copy)
            print(f"[{time.perf_counter() - t0:4.0f}s] {label} ctx {ctx} b{b}: {nbytes / 1e6:.1f} MB, "
                  f"copy {copy:,.0f} GB/s", flush=True)
    print_tables(table, cells)
    for label in DTYPES:
        for ctx, b in ((int(c), int(bb)) for c, bb in (cell.split("x") for cell in a.check.split(",") if cell)):
            errs = error_check(label, names, plan, ctx, b)
            print(f"max |err| vs fp32 reference, {label} ctx {ctx} b{b}: "
                  + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()), flush=True)
    print(f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
