"""Qwen3-Next-80B-A3B on one GPU: moe_gpu.py's sections at its expert shape (512 experts, top 10,
hidden 2048, expert width 512; --tp 2 halves the width as one rank of TP=2 holds it) and its
engine section on the whole model (assets/model_configs, dummy W4A16 weights, ~43 GB).

    python3 benchmarks/qwen3_next_gpu.py [--quick] [--tp 2] [--json out.json]

moe_gpu's module constants are set to this shape, so the same code measures both models:
  check    moe_align, the bf16 and W4A16 fused paths vs the torch references (bound 2e-2), for
           1 / 8 / 32 (and 2,048 without --quick) tokens; top_k 10 is not a power of two
  router   the Triton router at 512 experts / top 10 vs torch (ids equal on fp32 logits)
  decode   batch 1 / 8 / 32 of one MoE layer: expert bytes over time vs the copy roofline
  engine   the whole model through LLMEngine: weights GB, active parameters, batch-1 and batch-8
           decode tok/s, and the batch-1 roofline from the bytes one token reads (all weights but
           the 502 unpicked experts per layer and the embedding table)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moe_gpu  # noqa: E402
from gpu_harness import report, run_sections  # noqa: E402

moe_gpu.E, moe_gpu.TOP_K, moe_gpu.HIDDEN, moe_gpu.INTER = 512, 10, 2048, 512
moe_gpu.ENGINE_CONFIG = "Qwen3-Next-80B-A3B.json"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tp", type=int, default=1, help="expert width of one rank at this TP size")
    p.add_argument("--sections", default="check,router,decode,engine")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    setup = moe_gpu.Setup(moe_gpu.INTER // a.tp)
    copy_gbps = moe_gpu.peak_copy_gbps()
    report("peak.copy_GBps", copy_gbps)
    sections = {
        "check": lambda: moe_gpu.section_check(setup, a.quick),
        "router": lambda: moe_gpu.section_router(a.quick),
        "decode": lambda: moe_gpu.section_decode(setup, a.quick, copy_gbps),
        "engine": lambda: moe_gpu.section_engine(a.quick, copy_gbps, "w4a16"),
    }
    return run_sections(sections, a.sections, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
