"""Decode attention at batch 1 over long contexts, int8 vs bf16 KV, split and tile variants (H200).

    python3 benchmarks/int8kv_decode.py [--quick] [--ctx 64,1024,16384,65536]

Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head_dim 128, page 16), one query
token, the pages scattered through the pool. Each call runs inside a CUDA graph that cycles
through enough copies of the cache to overflow the L2 (gpu_timing.py). Reported: microseconds per
layer, the GB/s of K + V (+ the int8 scales) and % of the copy rate of the same bytes in the same
run, and x32 layers: the milliseconds a decode step spends in attention at that context.

Variants: "sN" = N KV splits (the engine's decode graphs use cuda_graphs.kv_splits_for; the
default row "table" is what paged_decode_attention picks without a split count), then the split
kernel's tiles ("b64w4s3" = block_n 64, 4 warps, 3 stages; tuning.TABLE[arch].decode is the
unmarked one). The last lines name the fastest int8 variant per context and its ratio to bf16.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import copies_for, copy_rate_gbs, default_jobs, graph_ms, precompile  # noqa: E402
from homelab_llm.engine.cuda_graphs import kv_splits_for  # noqa: E402
from homelab_llm.engine.kernels.decode_attention import paged_decode_attention  # noqa: E402
from homelab_llm.engine.kernels.tuning import AttentionTiles, tiles_for  # noqa: E402

HQ, HKV, D, PAGE, LAYERS = 32, 8, 128, 16, 32
TILES = {
    "b64w4s1": AttentionTiles(64, 4, 1),
    "b64w4s2": AttentionTiles(64, 4, 2),
    "b128w8s2": AttentionTiles(128, 8, 2),
    "b32w4s2": AttentionTiles(32, 4, 2),
}
SPLITS = (16, 32, 64, 128)


def make_cache(ctx: int, dtype: torch.dtype, gen: torch.Generator, dev: torch.device):
    """(k, v, k_scale, v_scale, page_table, nbytes) for one sequence of ctx tokens."""
    pages = -(-ctx // PAGE) + 1
    shape = (pages, PAGE, HKV, D)
    if dtype == torch.int8:
        k = torch.randint(-127, 128, shape, generator=gen, device=dev, dtype=torch.int8)
        v = torch.randint(-127, 128, shape, generator=gen, device=dev, dtype=torch.int8)
        ks = (torch.rand(pages, PAGE, HKV, generator=gen, device=dev) * 0.02 + 0.01).half()
        vs = (torch.rand(pages, PAGE, HKV, generator=gen, device=dev) * 0.02 + 0.01).half()
        nbytes = 2 * ctx * HKV * (D + 2)
    else:
        k = torch.randn(shape, generator=gen, device=dev).to(dtype)
        v = torch.randn(shape, generator=gen, device=dev).to(dtype)
        ks = vs = None
        nbytes = 2 * ctx * HKV * D * 2
    table = torch.randperm(pages, generator=gen, device=dev).to(torch.int32)[None, :]
    return k, v, ks, vs, table, nbytes


def variants(ctx: int, quick: bool) -> dict:
    """name -> (num_splits or None, tiles or None)."""
    table = tiles_for(torch.device("cuda")).decode
    out = {"table": (None, None)}
    for s in SPLITS:
        out[f"s{s}"] = (s, None)
        if ctx == 16384 and not quick:  # the full tile grid where the target is measured
            for name, t in TILES.items():
                if t != table:
                    out[f"s{s}.{name}"] = (s, t)
    if quick or ctx != 16384:
        for s in (32, 64):
            out[f"s{s}.b64w4s1"] = (s, TILES["b64w4s1"])
    return out


DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8}


def bench_ctx(ctx: int, label: str, quick: bool, compile_only: str = "") -> tuple[dict, float]:
    """variant -> ms per call at this context, and the bytes a call reads; compile_only: call
    that one variant once on a short cache (a precompile worker; the compiled code does not
    depend on the length)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(ctx)
    variant_set = variants(ctx, quick)
    if compile_only:
        variant_set = {compile_only: variant_set[compile_only]}
        ctx = min(ctx, 1024)
    first = make_cache(ctx, DTYPES[label], gen, dev)
    nbytes = first[-1]
    copies = 1 if compile_only else copies_for(nbytes, cap=32)
    caches = [first] + [make_cache(ctx, DTYPES[label], gen, dev) for _ in range(copies - 1)]
    q = torch.randn(1, HQ, D, generator=gen, device=dev).to(torch.bfloat16)
    qsl = torch.arange(2, dtype=torch.int32, device=dev)
    sl = torch.tensor([ctx], dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    res = {}
    for name, (splits, tiles) in variant_set.items():
        def step(i, splits=splits, tiles=tiles):
            k, v, ks, vs, table, _ = caches[i]
            return paged_decode_attention(q, k, v, table, qsl, sl, D ** -0.5, ks, vs, num_splits=splits,
                                          out=out, tiles=tiles)
        try:
            if compile_only:
                step(0)
            else:
                res[name] = graph_ms(step, copies)
        except Exception as exc:  # a variant that fails is reported, not fatal
            if not compile_only:
                print(f"  ctx {ctx} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    torch.cuda.synchronize()
    return res, nbytes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer tile variants")
    p.add_argument("--ctx", default="64,1024,16384,65536")
    p.add_argument("--jobs", type=int, default=default_jobs(), help="processes that compile first (1: none)")
    p.add_argument("--step-ms", type=float, default=4.97,
                   help="a short-context decode step without attention (default: the 8B bf16 engine's)")
    a = p.parse_args()
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    print(f"{torch.cuda.get_device_name(dev)}: copy rate {copy_rate_gbs(dev):,.0f} GB/s (read + write, 1 GiB); "
          f"table decode tiles {tiles_for(dev).decode}", flush=True)
    ctxs = [int(c) for c in a.ctx.split(",")]
    tasks = {(variants(c, a.quick)[v], label): (c, label, a.quick, v) for c in ctxs for label in DTYPES
             for v in variants(c, a.quick)}  # one task per distinct (splits, tiles, dtype)
    secs = precompile(bench_ctx, list(tasks.values()), a.jobs)
    print(f"[{time.perf_counter() - t0:4.0f}s] compiled in {a.jobs} processes ({secs:.0f} s)", flush=True)
    best: dict[tuple[int, str], tuple[str, float]] = {}
    for ctx in ctxs:
        for label in DTYPES:
            res, nbytes = bench_ctx(ctx, label, a.quick)
            torch.cuda.empty_cache()  # the context's cache copies went with bench_ctx's frame
            if not res:
                continue
            copy = copy_rate_gbs(dev, nbytes)
            cells = [f"{n} {ms * 1e3:6.1f}us {100 * nbytes / ms / 1e6 / copy:3.0f}%"
                     for n, ms in sorted(res.items(), key=lambda kv: kv[1])]
            name, ms = min(res.items(), key=lambda kv: kv[1])
            best[(ctx, label)] = (name, ms)
            print(f"[{time.perf_counter() - t0:4.0f}s] ctx {ctx:6d} {label} {nbytes / 1e6:7.1f}MB copy {copy:5.0f}GB/s "
                  f"| table {res.get('table', float('nan')) * 1e3:6.1f}us | best {name} x{LAYERS} layers = "
                  f"{ms * LAYERS:.3f} ms/step | " + " | ".join(cells[:8]), flush=True)
    print("\nSUMMARY (best variant per context; ms per decode step = x32 layers)")
    for (ctx, label), (name, ms) in sorted(best.items()):
        bf = best.get((ctx, "bf16"))
        ratio = f" int8/bf16 time {ms / bf[1]:.2f}" if label == "int8" and bf else ""
        print(f"ctx {ctx:6d} {label}: {name} {ms * 1e3:.1f} us/layer, {ms * LAYERS:.3f} ms/step{ratio}")
    graph = kv_splits_for(17408, PAGE, tiles_for(dev).max_kv_splits)
    print(f"engine decode graphs at batch 1 (engine_gpu's long section, max_model_len 17408): s{graph}")
    short = best.get((min(ctxs), "int8"))
    for ctx in ctxs:
        if short and (ctx, "int8") in best and ctx > min(ctxs):
            extra = (best[(ctx, "int8")][1] - short[1]) * LAYERS
            print(f"int8 KV ctx {ctx} / ctx {min(ctxs)} decode rate with a {a.step_ms} ms step: "
                  f"{a.step_ms / (a.step_ms + extra):.3f} (target at 16K: >= 0.95)")
    print(f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
