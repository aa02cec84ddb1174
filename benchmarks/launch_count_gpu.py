"""Kernel launches and GPU time of one batch-1 decode step (issues 17/19), on a CUDA machine.

    python3 benchmarks/launch_count_gpu.py [--config Qwen3.6-27B.json] [--quant w4a16] [--ab]
                                           [--root DIR]

Builds the dummy-weight engine (default: the reference deployment, Qwen3.6-27B W4A16) and prints
the graph replay's GPU ms a step and batch-1 tok/s, then an eager step's launches and kernel time
(torch.profiler) with the kernels grouped by name, most time first. --ab repeats both with
HOMELAB_LLM_DENSE_GEMV=0 (narrow linears such as Gated DeltaNet's in_proj_ba back on cuBLAS,
split-K + reduce), so the GEMV route's effect is measured on the same box. --root runs another
checkout's engine (e.g. main before issue 19) with this script, for a before/after. The CPU test
tests/engine/kernels/test_launch_count.py pins the same count for a tiny model.
Under 3 minutes on an H200 without --ab (two engine builds).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from w4a16_regress import eager_kernels, graph_decode, make_engine  # noqa: E402

PROMPT = list(range(100, 132))


def measure(config: str, quant: str, tokens: int, top: int, label: str) -> tuple[float, float]:
    """Print one variant's lines; returns (graph GPU ms a step, launches a step)."""
    import torch

    eng = make_engine(config, quant)
    wall, gpu, replays = graph_decode(eng, PROMPT, tokens)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    rows = eager_kernels(make_engine(config, quant, enforce_eager=True), PROMPT)
    launches, us = sum(r[1] for r in rows), sum(r[0] for r in rows)
    print(f"LAUNCHES {label}: {launches:.0f} launches/step, eager kernels {us:.0f} us/step; graph "
          f"GPU {gpu:.3f} ms/step ({replays} replays), b1 {1e3 / wall:.1f} tok/s", flush=True)
    for k_us, count, name in rows[:top]:
        print(f"  {k_us:8.1f} us {count:6.1f}/step {name[:96]}", flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    return gpu, launches


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1]),
                   help="the checkout whose engine runs (default: this one)")
    p.add_argument("--config", default="Qwen3.6-27B.json")
    p.add_argument("--quant", default="w4a16", help="quantization (w4a16) or none (bf16)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=24, help="kernel rows printed per variant")
    p.add_argument("--ab", action="store_true",
                   help="also measure with HOMELAB_LLM_DENSE_GEMV=0 (narrow linears on cuBLAS)")
    a = p.parse_args()
    sys.path.insert(0, a.root)
    name = f"{Path(a.root).name} {Path(a.config).stem}"
    gpu, launches = measure(a.config, a.quant, a.tokens, a.top, f"{name} {a.quant}")
    if a.ab:
        os.environ["HOMELAB_LLM_DENSE_GEMV"] = "0"
        gpu0, launches0 = measure(a.config, a.quant, a.tokens, a.top, f"{name} {a.quant} DENSE_GEMV=0")
        print(f"LAUNCHES narrow-linear GEMV: {launches0 - launches:+.0f} launches saved, "
              f"{gpu0 - gpu:+.3f} ms/step saved", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
