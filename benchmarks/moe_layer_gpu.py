"""moe_gpu.py's sections for the MoE decode step (issue 15): one whole MoE layer (router + experts)
old vs new, a tile sweep of the fused decode kernels, and launches per engine decode step.

layer: batch 1 and 8, bf16 and W4A16, router + experts timed in one CUDA graph that cycles
  through 16 copies of the inputs (different router weights, so different experts each call: a
  replay reads its experts from HBM, as the 48 layers of a step do, not from the 50 MB L2).
  old = cuBLAS gate matmul + route_topk + the older expert path (4-bit: the GEMV + combine
  launch; bf16: the tl.dot GEMM path); new = route_gate_topk + fused_moe_decode (two launches).
  The roofline: the bytes the picks imply (each distinct expert read once, plus the router) at
  the measured copy rate.
sweep_decode: fused_moe_decode under MoeDecodeTiles variants and the router under RouterTiles.
launches: the dummy W4A16 model eager at batch 1: kernel launches per decode step, in all and
  in the MoE kernels, and their GPU time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_harness import report
from gpu_timing import graph_ms
from homelab_llm.engine.kernels.fused_moe import fused_moe
from homelab_llm.engine.kernels.moe_router import route_gate_topk, route_topk
from homelab_llm.engine.kernels.tuning import MoeDecodeTiles, RouterTiles

COPIES = 16  # x 8 experts at batch 1: every one of 128 experts once per replay


@dataclass
class Layer:
    """One MoE layer's weights as the benchmark's Setup holds them, and its shape."""

    w13: object  # dense [E, 2I, H] tensor or MoeW4
    w2: object
    expert_bytes: int
    experts: int
    top_k: int
    hidden: int


def router_inputs(layer: Layer, tokens: int, dev: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """COPIES (x, router weight) pairs. Batch 1: copy i's router prefers experts group i of a
    random permutation (logit ~4 against ~0), so consecutive calls share no expert; batch 8:
    random routers (spread picks, about 52 distinct experts a call)."""
    gen = torch.Generator(device=dev).manual_seed(tokens)
    perm = torch.randperm(layer.experts, device=dev, generator=gen)
    out = []
    for i in range(COPIES):
        x = torch.randn(tokens, layer.hidden, device=dev, generator=gen)
        w = torch.randn(layer.experts, layer.hidden, device=dev, generator=gen) * 0.02
        if tokens == 1:
            x[:, 0] = 1.0
            w[:, 0] = 0.0
            group = perm[(i * layer.top_k) % layer.experts:][:layer.top_k]
            w[group, 0] = 4.0 + 0.1 * torch.arange(layer.top_k, device=dev)
            w[:, 1:] *= 0.05
        out.append((x.bfloat16(), w.bfloat16()))
    return out


def active_bytes(layer: Layer, inputs) -> float:
    """Mean bytes a call reads: its distinct experts' weights and the router's weight."""
    total = 0
    for x, w in inputs:
        _, ids = route_topk(F.linear(x, w), layer.top_k, True)
        total += len(torch.unique(ids)) * layer.expert_bytes + w.numel() * w.element_size()
    return total / len(inputs)


def _old_layer(layer: Layer, w4: bool):
    def step(x, w):
        weights, ids = route_topk(F.linear(x, w), layer.top_k, True)
        return fused_moe(x, layer.w13, layer.w2, weights, ids, decode="gemv" if w4 else "gemm")
    return step


def _new_layer(layer: Layer, tiles: MoeDecodeTiles | None = None,
               router: RouterTiles | None = None):
    from homelab_llm.engine.kernels.fused_moe_decode import moe_decode

    def step(x, w):
        weights, ids, _ = route_gate_topk(x, w, layer.top_k, True, tiles=router)
        return moe_decode(x, layer.w13, layer.w2, weights, ids, tiles=tiles)
    return step


def time_layer(step, inputs) -> float:
    return graph_ms(lambda i: step(*inputs[i]), len(inputs))


def section_layer(layers: dict[str, Layer], copy_gbps: float) -> None:
    for kind, layer in layers.items():
        for tokens in (1, 8):
            inputs = router_inputs(layer, tokens, torch.device("cuda"))
            nbytes = active_bytes(layer, inputs)
            roof_ms = nbytes / copy_gbps / 1e6
            x, w = inputs[0]
            old_out, new_out = _old_layer(layer, kind == "w4a16")(x, w), _new_layer(layer)(x, w)
            err = float((new_out.float() - old_out.float()).norm() / old_out.float().norm())
            report(f"layer.{kind}.b{tokens}.active_MB", nbytes / 1e6)
            report(f"layer.{kind}.b{tokens}.new_vs_old_rel_err", err, "(bf16 roundings differ: ~1e-2)")
            for name, step in (("old", _old_layer(layer, kind == "w4a16")), ("new", _new_layer(layer))):
                ms = time_layer(step, inputs)
                report(f"layer.{kind}.b{tokens}.{name}_us", ms * 1e3,
                       f"{100 * roof_ms / ms:.1f}% of the copy rate of its active bytes")


DECODE_SWEEP = [  # (block_n, block_k, steps, num_warps)
    (64, 128, 1, 4), (32, 128, 1, 4), (128, 128, 1, 4), (64, 128, 1, 2), (128, 128, 1, 8),
    (64, 128, 2, 4), (64, 64, 1, 2), (256, 128, 1, 8),
]
# dense (bf16/fp16) experts also try the dense decode GEMV's winning shape (BENCHMARKS 13.1): a
# few rows a program over a long K step, 2 warps
DENSE_DECODE_SWEEP = [
    (1, 1024, 1, 2), (2, 1024, 1, 2), (4, 1024, 1, 2), (2, 512, 1, 2), (4, 512, 1, 2),
    (8, 512, 1, 2), (4, 256, 1, 2), (8, 256, 1, 2), (16, 256, 1, 2), (4, 512, 1, 4),
    (4, 256, 2, 2), (8, 128, 2, 2), (16, 128, 1, 2),
]
ROUTER_SWEEP = [(1, 1024, 4), (1, 2048, 8), (2, 512, 4), (4, 256, 4), (1, 2048, 1), (1, 1024, 1),
                (1, 2048, 2), (2, 1024, 2), (2, 1024, 1)]


def section_sweep_decode(layers: dict[str, Layer]) -> None:
    """The fused layer under tile variants (the table's router for expert tiles, the table's
    expert tiles for router tiles)."""
    for kind, layer in layers.items():
        for tokens in (1, 8):
            inputs = router_inputs(layer, tokens, torch.device("cuda"))
            variants = DECODE_SWEEP + (DENSE_DECODE_SWEEP if kind != "w4a16" else [])
            for block_n, block_k, steps, warps in variants:
                tiles = MoeDecodeTiles(block_n, block_k, steps, warps)
                report_variant(f"sweep_decode.{kind}.b{tokens}.n{block_n}k{block_k}s{steps}w{warps}",
                         _new_layer(layer, tiles=tiles), inputs)
            if kind == "w4a16":
                for block_e, block_k, warps in ROUTER_SWEEP:
                    report_variant(f"sweep_router.b{tokens}.e{block_e}k{block_k}w{warps}",
                             _new_layer(layer, router=RouterTiles(block_e, block_k, warps)), inputs)


def report_variant(key: str, step, inputs) -> None:
    try:
        report(f"{key}.us", time_layer(step, inputs) * 1e3)
    except Exception as exc:  # a variant that does not fit is reported, not fatal
        print(f"  {key}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)


MOE_KERNELS = ("moe", "route", "align", "combine")


def section_launches(config: str, steps: int = 8) -> None:
    """Eager batch-1 decode of the dummy W4A16 model: launches and GPU time per step, all kernels
    and the MoE ones (names containing one of MOE_KERNELS)."""
    from engine_gpu import kernel_totals, make_engine

    engine = make_engine(config, quantization="w4a16", max_model_len=4096, max_num_seqs=8,
                         enforce_eager=True)
    totals = kernel_totals(engine, list(range(100, 132)), "launches", steps)
    layers = engine.model_config.num_hidden_layers
    moe = {name: v for name, v in totals.items() if any(w in name.lower() for w in MOE_KERNELS)}
    for name, (us, count) in sorted(moe.items(), key=lambda kv: -kv[1][0]):
        print(f"  {us:8.1f} us  {count:6.1f}/step  {name[:90]}", flush=True)
    total = sum(v[1] for v in totals.values())
    report("launches.w4a16.b1.per_step", total,
           f"{sum(v[0] for v in totals.values()):.0f} us of kernels a step (eager)")
    report("launches.w4a16.b1.per_layer", total / layers, f"{layers} layers")
    report("launches.w4a16.b1.moe_per_layer", sum(v[1] for v in moe.values()) / layers,
           f"{sum(v[0] for v in moe.values()) / layers:.1f} us a layer (router + experts)")
    del engine
