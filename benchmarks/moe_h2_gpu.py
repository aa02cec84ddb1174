"""Decode-size 4-bit MoE experts: fused_moe_decode's kernels against the packed-half GEMV over the
picks (fused_moe_h2.py) under tile variants, one GPU.

    python3 benchmarks/moe_h2_gpu.py [--shapes 128x2048x768,256x2048x512] [--top-k 8] [--tokens 1,8]

For each experts shape (E x H x I: the Qwen3-30B-A3B's 128 x 2048 x 768, a 256-expert I 512
layer as the Qwen3.5/3.6-35B-A3B's) and batch (--tokens: T tokens a layer call; the table's
moe_h2_tokens says which T the engine routes to the packed-half path) the layer's two launches
run in one CUDA graph over 16 calls, each with its own fresh picks (random distinct experts per
token, softmax weights), so the picked experts' words come from HBM as in a decode step. Reported: microseconds a layer for the
old kernels (the table's MoeDecodeTiles), for the table's moe_h2 tiles (both also with a gated
shared expert's row added, as Qwen3.5-MoE does), and for gate_up / down tile variants (gate_up varied with the table's down, down with the table's gate_up); each with
its relative Frobenius error against the old kernels' output (both within ~5e-3 of each other
at bf16). docs/BENCHMARKS.md 36.2 has the H200's figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_harness import report  # noqa: E402
from gpu_timing import graph_ms  # noqa: E402
from homelab_llm.engine.kernels.fused_moe_decode import moe_decode  # noqa: E402
from homelab_llm.engine.kernels.fused_moe_h2 import moe_h2, moe_h2_route  # noqa: E402
from homelab_llm.engine.kernels.moe_ref import MoeW4  # noqa: E402
from homelab_llm.engine.kernels.tuning import RowsTiles, moe_decode_tiles, whole_k_fits  # noqa: E402
from tests.engine.kernels.moe_inputs import random_moe_w4, rel_err  # noqa: E402

TOKENS = 16  # graph copies, each its own token and picks


def whole_k(block_n: int, wrows: int, warps: int) -> RowsTiles:
    return RowsTiles(block_n, wrows, warps, prefetch=True, whole_k=True)


# (columns, word rows a step, warps) of the whole-K candidates for each GEMV
UP_VARIANTS = ((64, 8, 8), (64, 4, 8), (128, 8, 8), (32, 4, 16), (64, 8, 16))
DOWN_VARIANTS = ((32, 4, 2), (128, 4, 8), (128, 8, 4), (64, 4, 2), (32, 4, 4), (64, 8, 8))


def name(t: RowsTiles) -> str:
    return f"{t.block_n}r{t.wrows}w{t.num_warps}"


def bench_shape(experts: int, hidden: int, inter: int, top_k: int, tokens: int,
                group: int = 128) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(experts + inter)
    w = MoeW4(random_moe_w4(gen, experts, hidden, 2 * inter, group, dev),
              random_moe_w4(gen, experts, inter, hidden, group, dev))
    xs = [(torch.randn(tokens, hidden, generator=gen) * 0.5).bfloat16().to(dev)
          for _ in range(TOKENS)]
    ids = [torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
           .int().to(dev) for _ in range(TOKENS)]
    wts = [torch.softmax(torch.randn(tokens, top_k, generator=gen), -1).to(dev)
           for _ in range(TOKENS)]
    tag = f"moe_h2.e{experts}h{hidden}i{inter}.b{tokens}"
    old = moe_decode_tiles(dev).w4
    want = moe_decode(xs[0], w, None, wts[0], ids[0], tiles=old)
    us = graph_ms(lambda i: moe_decode(xs[i], w, None, wts[i], ids[i], tiles=old), TOKENS) * 1e3
    report(f"{tag}.old_us", us, "fused_moe_decode's kernels (the table's MoeDecodeTiles)")
    table = moe_h2_route(xs[0][:1], w)
    if table is None:
        print(f"  {tag}: no moe_h2 entry fits on this arch; variants only", flush=True)
        table = (whole_k(32, 4, 8), whole_k(64, 4, 4))
    pairs = [("table", table)]
    if tokens == 1:  # the tile sweep at batch 1; past it the table's tiles only
        pairs += [(f"up{name(whole_k(*v))}", (whole_k(*v), table[1])) for v in UP_VARIANTS]
        pairs += [(f"down{name(whole_k(*v))}", (table[0], whole_k(*v))) for v in DOWN_VARIANTS]
    shared = ((torch.randn(tokens, hidden, generator=gen) * 0.5).bfloat16().to(dev),
              torch.full((tokens,), 0.5, device=dev))
    us = graph_ms(lambda i: moe_decode(xs[i], w, None, wts[i], ids[i], tiles=old, shared=shared),
                  TOKENS) * 1e3
    report(f"{tag}.old_shared_us", us, "the old kernels with a gated shared expert's row")
    us = graph_ms(lambda i: moe_h2(xs[i], w, wts[i], ids[i], table, shared=shared), TOKENS) * 1e3
    err = rel_err(moe_h2(xs[0], w, wts[0], ids[0], table, shared=shared),
                  moe_decode(xs[0], w, None, wts[0], ids[0], tiles=old, shared=shared))
    report(f"{tag}.table_shared_us", us, f"the same row in down's sum (Picks.add), rel err {err:.1e}")
    for label, tiles in pairs:
        if not (whole_k_fits(tiles[0], hidden, group) and whole_k_fits(tiles[1], inter, group)):
            continue
        err = rel_err(moe_h2(xs[0], w, wts[0], ids[0], tiles), want)
        us = graph_ms(lambda i, t=tiles: moe_h2(xs[i], w, wts[i], ids[i], t), TOKENS) * 1e3
        report(f"{tag}.{label}_us", us, f"up {name(tiles[0])} down {name(tiles[1])}, "
                                        f"rel err {err:.1e} against the old kernels")


def shapes_cli(bench) -> int:
    """--shapes, --top-k and --tokens, then bench(experts, hidden, inter, top_k, tokens) for each
    shape and batch (moe_queue_gpu.py's command line too)."""
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="128x2048x768,256x2048x512", help="E x H x I, comma-separated")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", default="1,8", help="tokens a layer call, comma-separated")
    a = p.parse_args()
    for shape in a.shapes.split(","):
        experts, hidden, inter = (int(v) for v in shape.split("x"))
        for tokens in (int(v) for v in a.tokens.split(",")):
            bench(experts, hidden, inter, a.top_k, tokens)
    return 0


def main() -> int:
    return shapes_cli(bench_shape)


if __name__ == "__main__":
    raise SystemExit(main())
