"""Tile sweep for the W4A16 decode GEMV on one GPU (feeds the `gemv_rows` entries in tuning.py).

    python benchmarks/w4a16_sweep.py [--quick]

For each decode shape (Llama-3.1-8B and Qwen3-32B linears, whole and as TP=2 shards) and each
tile variant: time inside a CUDA graph (so launch cost is the GPU's, as in decode), the bytes the
weight occupies (packed nibbles + scales + biases) over that time, the old GEMM-kernel path and
torch's bf16 matmul on the same shape, and a correctness check against the dequantized reference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from homelab_llm.engine.kernels.ref import dequantize_w4_ref  # noqa: E402
from homelab_llm.engine.kernels.tuning import gemm_tiles  # noqa: E402
from homelab_llm.engine.kernels.w4a16 import w4a16_matmul  # noqa: E402
from homelab_llm.engine.kernels.w4a16_gemv import w4a16_gemv  # noqa: E402
from homelab_llm.engine.kernels.w4a16_pack import quantize_rtn  # noqa: E402

SHAPES = {  # name: (K, N)
    "8b.qkv": (4096, 6144), "8b.o": (4096, 4096), "8b.gate_up": (4096, 28672), "8b.down": (14336, 4096),
    "8b.gate_up/2": (4096, 14336), "8b.down/2": (7168, 4096),
    "32b.qkv/2": (5120, 5120), "32b.o/2": (4096, 5120), "32b.gate_up/2": (5120, 25600),
    "32b.down/2": (12800, 5120),
}
VARIANTS = [  # (block_n, rows, num_warps); prefetching the next tile was tried: no gain (2026-11-29)
    (64, 16, 4), (32, 16, 4), (64, 8, 4), (64, 16, 8), (128, 16, 4), (128, 16, 8), (256, 16, 8),
]


def bench(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=40)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--m", default="1")
    p.add_argument("--lite", action="store_true", help="four variants, two split choices")
    a = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    quick = ("8b.qkv", "8b.o", "8b.gate_up", "8b.down", "32b.gate_up/2", "32b.down/2")
    shapes = {k: v for k, v in SHAPES.items() if k in quick} if a.quick else SHAPES
    best_per_shape = {}
    for m in [int(v) for v in a.m.split(",")]:
        for name, (k, n) in shapes.items():
            w = quantize_rtn((torch.randn(n, k, generator=gen) * 0.05).to(dev), 128, True)
            nbytes = w.qweight.numel() * 4 + w.scales.numel() * w.scales.element_size() * 2
            x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
            want = x.float() @ dequantize_w4_ref(w)
            dense = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
            ms_dense = bench(lambda: x @ dense)
            ms_old = bench(lambda: w4a16_matmul(x, w, tiles=gemm_tiles(m, dev)))
            out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
            rows = []
            variants = VARIANTS if not a.lite else [VARIANTS[i] for i in (0, 1, 5)]
            for bn, r, nw in variants:
                for split in ((None, 8) if a.lite else (None, 4, 8, 16)):
                    try:
                        got = w4a16_gemv(x, w, out, block_n=bn, rows=r, split=split, num_warps=nw)
                        err = float((got.float() - want).norm() / want.norm())
                        ms = bench(lambda: w4a16_gemv(x, w, out, block_n=bn, rows=r, split=split,
                                                      num_warps=nw))
                    except Exception as exc:  # a variant that does not compile is reported, not fatal
                        print(f"  {name} bn={bn} rows={r} warps={nw} split={split}: {exc}", flush=True)
                        continue
                    rows.append((ms, bn, r, nw, split, err))
            rows.sort()
            ms, bn, r, nw, split, err = rows[0]
            auto = [row for row in rows if row[1:5] == (64, 16, 4, None)]
            auto_ms = auto[0][0] if auto else float("nan")
            print(f"M={m} {name:14s} K={k:5d} N={n:5d}  best {ms * 1e3:6.1f} us "
                  f"({nbytes / ms / 1e6:5.0f} GB/s) bn={bn} rows={r} warps={nw} split={split} err={err:.1e} | "
                  f"default {auto_ms * 1e3:6.1f} us | old {ms_old * 1e3:6.1f} us | bf16 {ms_dense * 1e3:6.1f} us "
                  f"({k * n * 2 / ms_dense / 1e6:5.0f} GB/s)", flush=True)
            top = ", ".join(f"{row[0] * 1e3:.1f}us bn{row[1]} r{row[2]} w{row[3]} s{row[4]}" for row in rows[:5])
            print(f"    top: {top}", flush=True)
            best_per_shape[(m, name)] = rows[0]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
