"""moe_gpu.py's `layer_gemv` section: the bf16 MoE layer at batch 1 as decode GEMVs
(kernels/moe_gemv.py: the norm inside the router's and gate_up's launches, three launches) against
the path it would replace (add_rms_norm, route_gate_topk, fused_moe_decode: four launches), then
the GEMV route under tile variants.

Timed as moe_layer_gpu's `layer`: one CUDA graph cycles through 16 inputs whose routers pick
disjoint experts, so every replay reads its experts from HBM. The roofline: the bytes the picks
imply at the measured copy rate. `layer_gemv.bf16.b1.gemv_us` against `.decode_us` decides
tuning.DenseGemvTiles.moe_rows (the route is off until it wins); the sweep's best tiles go to
new "experts_up" / "experts_down" kinds if they beat the table's.
"""

from __future__ import annotations

import torch

from gpu_harness import report
from homelab_llm.engine.kernels.elementwise import add_rms_norm
from homelab_llm.engine.kernels.fused_moe_decode import moe_decode
from homelab_llm.engine.kernels.moe_gemv import moe_gemv
from homelab_llm.engine.kernels.moe_router import route_gate_topk
from moe_layer_gpu import Layer, active_bytes, report_variant, router_inputs, time_layer

# (block_n, block_k, num_warps, num_stages) for gate_up (per pick, K = hidden)
UP_SWEEP = [(2, 1024, 4, 1), (1, 1024, 2, 1), (2, 512, 2, 1), (4, 512, 2, 1), (4, 512, 4, 1),
            (2, 1024, 2, 1), (1, 2048, 4, 1), (2, 512, 2, 3), (4, 256, 2, 3), (8, 256, 4, 1)]
# for down (K = the expert width: a step stays within one pick, so <= 256 at width 768)
DOWN_SWEEP = [(2, 256, 2, 1), (4, 256, 2, 1), (8, 256, 4, 1), (4, 128, 2, 1), (8, 128, 2, 1),
              (4, 256, 2, 3), (8, 256, 2, 3), (16, 128, 4, 1)]


def _tiles(t: tuple[int, int, int, int]) -> dict:
    return dict(block_n=t[0], block_k=t[1], num_warps=t[2], num_stages=t[3])


def _decode_path(layer: Layer, nw: torch.Tensor, residual: torch.Tensor):
    def step(x, w):
        normed, _ = add_rms_norm(x, residual, nw, 1e-6)
        weights, ids, _ = route_gate_topk(normed, w, layer.top_k, True)
        return moe_decode(normed, layer.w13, layer.w2, weights, ids)
    return step


def _gemv_path(layer: Layer, nw: torch.Tensor, residual: torch.Tensor, up=None, down=None):
    def step(x, w):
        weights, ids, _ = route_gate_topk(x, w, layer.top_k, True, norm_weight=nw, eps=1e-6,
                                          residual=residual)
        return moe_gemv(x, layer.w13, layer.w2, weights, ids, norm_weight=nw, eps=1e-6,
                        residual=residual, up_tiles=up, down_tiles=down)[0]
    return step


def section_layer_gemv(layers: dict[str, Layer], copy_gbps: float) -> None:
    layer = layers["bf16"]
    dev = torch.device("cuda")
    inputs = router_inputs(layer, 1, dev)
    # residual 0 and norm weight 1: the router inputs' designed picks survive the norm
    residual = torch.zeros(1, layer.hidden, device=dev, dtype=torch.bfloat16)
    nw = torch.ones(layer.hidden, device=dev, dtype=torch.bfloat16)
    roof_ms = active_bytes(layer, inputs) / copy_gbps / 1e6
    x, w = inputs[0]
    want = _decode_path(layer, nw, residual)(x, w)
    got = _gemv_path(layer, nw, residual)(x, w)
    err = float((got.float() - want.float()).norm() / want.float().norm())
    report("layer_gemv.bf16.b1.rel_err_vs_decode", err, "(bound 2e-2: bf16 roundings differ)")
    for name, step in (("decode", _decode_path(layer, nw, residual)),
                       ("gemv", _gemv_path(layer, nw, residual))):
        ms = time_layer(step, inputs)
        report(f"layer_gemv.bf16.b1.{name}_us", ms * 1e3,
               f"{100 * roof_ms / ms:.1f}% of the copy rate of its active bytes (norm included)")
    for up in UP_SWEEP:
        report_variant(f"layer_gemv.sweep.up_n{up[0]}k{up[1]}w{up[2]}s{up[3]}",
                 _gemv_path(layer, nw, residual, up=_tiles(up)), inputs)
    for down in DOWN_SWEEP:
        report_variant(f"layer_gemv.sweep.down_n{down[0]}k{down[1]}w{down[2]}s{down[3]}",
                 _gemv_path(layer, nw, residual, down=_tiles(down)), inputs)
