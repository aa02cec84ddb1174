"""W4A16 decode kernels on the Qwen3.6-27B hybrid's linears, old vs new, in one run (< 3 min, H200).

    python3 benchmarks/w4a16_sweep.py [--quick] [--m 1,2,4,8,16,32] [--tp 1,2]

For each linear shape (48 Gated DeltaNet + 16 attention layers; TP=2 shards: column-parallel
halves N, row-parallel halves K) and each row count M, every kernel variant is timed inside one
CUDA graph that cycles through enough copies of the weight to overflow L2 (a decode step reads its
weights from HBM, not from cache). Reported: microseconds, GB/s of the packed weight (nibbles +
scales + biases) and % of the device-to-device copy rate measured in the same run, torch bf16
matmul as the peer, and the worst per-row relative error against the dequantized reference.

The summary weighs each shape by how often a decode step runs it (per layer type and count) and
prints, per M, the step's linear time for each kernel family and the W4A16_ROUTES row for
engine/kernels/tuning.py that the numbers suggest.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from homelab_llm.engine.kernels.ref import dequantize_w4_ref  # noqa: E402
from homelab_llm.engine.kernels.tuning import GemmTiles, gemm_tiles  # noqa: E402
from homelab_llm.engine.kernels.w4a16 import w4a16_matmul  # noqa: E402
from homelab_llm.engine.kernels.w4a16_dot import w4a16_dot  # noqa: E402
from homelab_llm.engine.kernels.w4a16_gemv import w4a16_gemv  # noqa: E402
from homelab_llm.engine.model.w4a16_dummy import random_w4  # noqa: E402

HIDDEN, INTER, GDN_LAYERS, ATTN_LAYERS = 5120, 17408, 48, 16
# name: (K, N, layers that run it per step, parallel style: "col" splits N, "row" splits K)
LINEARS = {
    "gdn.in_proj_qkvz": (HIDDEN, 2 * 2048 + 2 * 6144, GDN_LAYERS, "col"),
    "gdn.out_proj": (6144, HIDDEN, GDN_LAYERS, "row"),
    "attn.qkv": (HIDDEN, 2 * 24 * 256 + 2 * 4 * 256, ATTN_LAYERS, "col"),
    "attn.o_proj": (24 * 256, HIDDEN, ATTN_LAYERS, "row"),
    "mlp.gate_up": (HIDDEN, 2 * INTER, GDN_LAYERS + ATTN_LAYERS, "col"),
    "mlp.down": (INTER, HIDDEN, GDN_LAYERS + ATTN_LAYERS, "row"),
}
L2_FLUSH_BYTES = 256 << 20  # weight copies cycled per graph: well past the H200's 50 MB L2

# Variants: name -> (family, callable(x, w, out)). The first of each M is what main dispatched
# before the route table: the GEMV up to 2 rows, the GEMM kernel from 3 rows.
def _variants(m: int, dev: torch.device) -> dict:
    if m <= 2:
        v = {"gemv": ("gemv", lambda x, w, out: w4a16_gemv(x, w, out)),
             "gemv.bn128w8": ("gemv", lambda x, w, out: w4a16_gemv(x, w, out, block_n=128, num_warps=8))}
    else:
        v = {"old.gemm": ("gemm", lambda x, w, out: w4a16_matmul(x, w, tiles=gemm_tiles(m, dev)))}
    v["dot"] = ("dot", lambda x, w, out: w4a16_dot(x, w, out))
    for name, tiles in DOT_TILES.items():
        if m > 2 or name != "dot.k256":
            v[name] = ("dot", lambda x, w, out, t=tiles: w4a16_dot(x, w, out, t))
    return v


# Candidate `w4a16_dot=` entries for tuning.TABLE (block_m, block_n, block_k, warps, stages, waves).
DOT_TILES = {
    "dot.bn128w8": GemmTiles(64, 128, 128, num_warps=8, num_stages=3, split_k=4),
    "dot.waves16": GemmTiles(64, 64, 128, num_warps=4, num_stages=3, split_k=16),
    "dot.k256": GemmTiles(64, 64, 256, num_warps=4, num_stages=3, split_k=4),
}


DEFAULTS = {"gemv": "gemv", "dot": "dot", "gemm": "old.gemm"}  # family -> its default-tile variant


def graph_ms(step, copies: int, iters: int = 3) -> float:
    """Milliseconds per call: one CUDA graph runs `step(i)` for every weight copy i; replays timed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm up (compiles) outside the capture
            step(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            step(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / copies)
    return sorted(times)[len(times) // 2]


def copy_rate_gbs(dev: torch.device) -> float:
    """Device-to-device copy: bytes read + written per second (the ceiling the GEMV is held to)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = graph_ms(lambda i: dst.copy_(src), copies=4)
    return 2 * src.numel() / ms / 1e6


def shapes_for(tps: list[int]) -> dict:
    out = {}
    for tp in tps:
        for name, (k, n, layers, style) in LINEARS.items():
            k_s, n_s = (k, n // tp) if style == "col" else (k // tp, n)
            out[f"{name}" + (f"/tp{tp}" if tp > 1 else "")] = (k_s, n_s, layers, tp)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="TP=1 only, M 1,8")
    p.add_argument("--m", default="1,2,4,8,16,32")
    p.add_argument("--tp", default="1,2")
    a = p.parse_args()
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    ms_list = [1, 8] if a.quick else [int(v) for v in a.m.split(",")]
    shapes = shapes_for([1] if a.quick else [int(v) for v in a.tp.split(",")])
    copy = copy_rate_gbs(dev)
    print(f"{torch.cuda.get_device_name(dev)}: copy rate {copy:,.0f} GB/s (read + write)", flush=True)
    results: dict[tuple[str, int], dict[str, float]] = {}  # (shape, m) -> variant -> ms
    worst_err = 0.0
    gen = torch.Generator(device=dev)
    for name, (k, n, layers, tp) in shapes.items():
        gen.manual_seed(k * 7 + n)
        w0 = random_w4(k, n, 128, gen, dev)
        nbytes = w0.qweight.numel() * 4 + w0.scales.numel() * 2 + w0.biases.numel() * w0.biases.element_size()
        copies = max(2, min(64, -(-L2_FLUSH_BYTES // nbytes)))
        ws = [w0] + [random_w4(k, n, 128, gen, dev) for _ in range(copies - 1)]
        dense_copies = max(2, min(64, -(-L2_FLUSH_BYTES // (k * n * 2))))
        dense = [torch.randn(k, n, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(dense_copies)]
        ref_w = dequantize_w4_ref(w0)
        for m in ms_list:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            want = x.float() @ ref_w
            out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
            row = {"bf16": graph_ms(lambda i: torch.matmul(x, dense[i]), dense_copies)}
            line = []
            for vname, (_, fn) in _variants(m, dev).items():
                try:
                    got = fn(x, w0, out).float()
                    err = float(((got - want).norm(dim=1) / want.norm(dim=1)).max())
                    row[vname] = graph_ms(lambda i: fn(x, ws[i], out), copies)
                except Exception as exc:  # a variant that fails is reported, not fatal
                    print(f"  {name} M={m} {vname}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                worst_err = max(worst_err, err)
                flag = " BAD" if err > 1e-2 else ""
                line.append(f"{vname} {row[vname] * 1e3:6.1f}us {nbytes / row[vname] / 1e6:5.0f}GB/s "
                            f"{100 * nbytes / row[vname] / 1e6 / copy:3.0f}%{flag}")
            results[(name, m)] = row
            print(f"[{time.perf_counter() - t0:4.0f}s] M={m:2d} {name:20s} K={k:5d} N={n:5d} "
                  f"{nbytes / 1e6:6.1f}MB | bf16 {row['bf16'] * 1e3:6.1f}us | " + " | ".join(line), flush=True)
    _summary(results, shapes, ms_list)
    print("dot variants' tiles (tuning.TABLE[arch].w4a16_dot):",
          "; ".join(f"{k} = {t}" for k, t in DOT_TILES.items()))
    print(f"worst per-row relative error {worst_err:.1e} (bound 1e-2); {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if worst_err < 1e-2 else 1


def _summary(results: dict, shapes: dict, ms_list: list[int]) -> None:
    """Per TP and M: one decode step's linear time (each shape x its layer count) per variant."""
    print("\nSUMMARY: one decode step's W4A16 linear time (ms), 48 GDN + 16 attention layers")
    families: dict[int, str] = {}
    for tp in sorted({v[3] for v in shapes.values()}):
        names = [s for s, v in shapes.items() if v[3] == tp]
        base = None
        for m in ms_list:
            rows = [results.get((s, m), {}) for s in names]
            variants = sorted(set.intersection(*(set(r) for r in rows))) if rows else []
            tot = {v: sum(results[(s, m)][v] * shapes[s][2] for s in names) for v in variants}
            if len(tot) < 2:
                continue
            best = min((v for v in tot if v != "bf16"), key=tot.get)
            base = base if base is not None else tot[best]
            print(f"TP={tp} M={m:2d}: best {best} {tot[best]:.2f} ms ({m * base / tot[best]:.1f}x batch-1 "
                  f"throughput) | " + " | ".join(f"{v} {t:.2f}" for v, t in sorted(tot.items(), key=lambda kv: kv[1])))
            if tp == 1:  # the table routes to each family's default tiles
                fam = {f: tot[v] for f, v in DEFAULTS.items() if v in tot}
                if fam:
                    families[m] = min(fam, key=fam.get)
    if not families:
        return
    routes = []
    found = [m for m in ms_list if m in families]
    for i, m in enumerate(found):
        if families[m] != (families[found[i + 1]] if i + 1 < len(found) else None):
            routes.append((m, families[m]))
    if routes[-1][1] == "gemm":
        routes[-1] = (1 << 62, "gemm")
    else:
        routes[-1] = (max(64, routes[-1][0]), routes[-1][1])
        routes.append((1 << 62, "gemm"))
    text = ", ".join(f"({'1 << 62' if r == 1 << 62 else r}, {f!r})" for r, f in routes)
    print(f"suggested tuning.W4A16_ROUTES entry (TP=1 step totals, each family at its default tiles): ({text})")


if __name__ == "__main__":
    raise SystemExit(main())
