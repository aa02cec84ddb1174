"""A pre-norm MoE block at decode sizes: its three launches (moe_router's norm + router, then
fused_moe_h2's gate_up and down) against the one-launch work queue (fused_moe_queue.py) under
tile variants, one GPU.

    python3 benchmarks/moe_queue_gpu.py [--shapes 128x2048x768,256x2048x512] [--top-k 8] [--tokens 1,8]

MOE_QUEUE_ONLY=a,b runs only the queue variants whose label contains a or b.

For each experts shape (E x H x I) and batch, COPIES blocks (each its own x, residual and so
its own picks, all weights shared as a layer's are) run in one CUDA graph; microseconds a block.
Each queue row gives its output's relative Frobenius error against the three launches' (their
router on the table's tiles) and the share of picks that agree (logits summed by other warp
counts can flip a near tie); "same" rows also run the three launches on the queue's own router
tiles, which must agree bit for bit.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_harness import report  # noqa: E402
from gpu_timing import graph_ms  # noqa: E402
from homelab_llm.engine.kernels.fused_moe_h2 import moe_h2, moe_h2_route  # noqa: E402
from homelab_llm.engine.kernels.fused_moe_queue import moe_queue, router_tiles  # noqa: E402
from homelab_llm.engine.kernels.moe_ref import MoeW4  # noqa: E402
from homelab_llm.engine.kernels.moe_router import route_gate_topk_norm  # noqa: E402
from homelab_llm.engine.kernels.tuning import QueueTiles, tiles_for, whole_k_fits  # noqa: E402
from moe_h2_gpu import name, shapes_cli, whole_k  # noqa: E402
from tests.engine.kernels.moe_inputs import random_moe_w4, rel_err  # noqa: E402

COPIES = 16


# (gate_up tiles, down tiles, router experts a program, poll pause ns)
T8, T4 = ((32, 4, 8), (128, 4, 8)), ((64, 4, 4), (64, 4, 4))
VARIANTS = ((*T8, 4, 0), (*T8, 4, 200), (*T8, 4, 1000), (*T8, 4, 3000), (*T8, 1, 1000), (*T4, 4, 1000),
            (*T4, 1, 1000), ((64, 8, 8), (128, 4, 8), 4, 1000), ((64, 8, 8), (128, 4, 8), 1, 1000))


def bench_shape(experts: int, hidden: int, inter: int, top_k: int, tokens: int,
                group: int = 128) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(experts + inter + tokens)
    w = MoeW4(random_moe_w4(gen, experts, hidden, 2 * inter, group, dev),
              random_moe_w4(gen, experts, inter, hidden, group, dev))
    xs = [torch.randn(tokens, hidden, generator=gen).bfloat16().to(dev) for _ in range(COPIES)]
    rs = [torch.randn(tokens, hidden, generator=gen).bfloat16().to(dev) for _ in range(COPIES)]
    nw = (torch.rand(hidden, generator=gen) + 0.5).bfloat16().to(dev)
    gate = (torch.randn(experts, hidden, generator=gen) * hidden ** -0.5).bfloat16().to(dev)
    tag = f"moe_queue.e{experts}h{hidden}i{inter}.b{tokens}"
    h2 = moe_h2_route(xs[0], w)
    if h2 is None:
        print(f"  {tag}: no moe_h2 entry on this arch", flush=True)
        return

    def three(i):
        wts, ids, _, normed, summed = route_gate_topk_norm(xs[i], rs[i], nw, 1e-6, gate, top_k, True)
        return moe_h2(normed, w, wts, ids, h2), ids

    want, want_ids = three(0)
    us = graph_ms(three, COPIES) * 1e3
    report(f"{tag}.three_us", us, f"route_gate_topk_norm + moe_h2 (up {name(h2[0])}, down {name(h2[1])})")
    table = tiles_for(dev).moe_queue
    variants = [("table", table)] if table is not None else []
    for up, down, block_e, pause in VARIANTS:
        variants.append((f"up{name(whole_k(*up))}.down{name(whole_k(*down))}.e{block_e}.ns{pause}",
                         QueueTiles(whole_k(*up), whole_k(*down), block_e, hidden, False, pause)))
    only = [v for v in os.environ.get("MOE_QUEUE_ONLY", "").split(",") if v]
    for label, tiles in variants:
        if only and not any(o in label for o in only):
            continue
        if not (whole_k_fits(tiles.up, hidden, group) and whole_k_fits(tiles.down, inter, group)):
            print(f"  {tag}.{label}: tiles do not fit", flush=True)
            continue
        try:
            got = moe_queue(xs[0], rs[0], nw, 1e-6, gate, top_k, True, w, tiles)
            err = rel_err(got.out, want)
            agree = float((got.ids == want_ids).float().mean())
            us = graph_ms(lambda i, t=tiles: moe_queue(xs[i], rs[i], nw, 1e-6, gate, top_k, True,
                                                       w, t), COPIES) * 1e3
        except Exception as exc:  # a variant that does not compile or run is reported, not fatal
            print(f"  {tag}.{label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        wts, ids, _, normed, _ = route_gate_topk_norm(xs[0], rs[0], nw, 1e-6, gate, top_k, True,
                                                      tiles=router_tiles(tiles, tokens))
        same = torch.equal(moe_h2(normed, w, wts, ids, (tiles.up, tiles.down)), got.out)
        report(f"{tag}.{label}_us", us, f"one launch; rel err {err:.1e}, picks agree {agree:.3f}, "
                                        f"bitwise as three launches on its tiles: {same}")


def main() -> int:
    return shapes_cli(bench_shape)


if __name__ == "__main__":
    raise SystemExit(main())
