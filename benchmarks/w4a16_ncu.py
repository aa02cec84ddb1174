"""Launch one W4A16 kernel at one shape a few times, for Nsight Compute to read (no timing here).

    ncu --clock-control none -k regex:w4a16 --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python3 benchmarks/w4a16_ncu.py --kernel dot --m 4 --k 5120 --n 34816

Kernels: h2 (packed-half GEMV), dot (few-row tensor-core kernel; --left for its left-operand loop),
gemv (the older one-row GEMV), rows (multi-row GEMV), deq (dequantize + BLAS). Launches 4 times:
the first compiles, so skip 2 and read the third.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from homelab_llm.engine.kernels.w4a16_deq import w4a16_deq_matmul  # noqa: E402
from homelab_llm.engine.kernels.w4a16_dot import w4a16_dot  # noqa: E402
from homelab_llm.engine.kernels.w4a16_gemv import w4a16_gemv  # noqa: E402
from homelab_llm.engine.kernels.w4a16_h2 import w4a16_h2  # noqa: E402
from homelab_llm.engine.kernels.w4a16_rows import w4a16_rows  # noqa: E402
from homelab_llm.engine.model.w4a16_dummy import random_w4  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", default="dot", choices=["h2", "dot", "gemv", "rows", "deq"])
    p.add_argument("--m", type=int, default=4)
    p.add_argument("--k", type=int, default=5120)
    p.add_argument("--n", type=int, default=34816)
    p.add_argument("--left", action="store_true",
                   help="dot: the weights as the left operand (route dotL) instead of eight dots a step")
    p.add_argument("--no-int-zeros", action="store_true",
                   help="dot --left: the weights' integer-zero flag off, so the table's offset / scaled "
                        "forms run instead of GemmTiles.int_zeros")
    a = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    w = random_w4(a.k, a.n, 128, gen, dev)
    w.int_zeros = not a.no_int_zeros
    x = torch.randn(a.m, a.k, device=dev, generator=gen).to(torch.bfloat16)
    out = torch.empty((a.m, a.n), dtype=torch.bfloat16, device=dev)
    fns = {"h2": lambda: w4a16_h2(x, w, out), "gemv": lambda: w4a16_gemv(x, w, out),
           "rows": lambda: w4a16_rows(x, w, out), "deq": lambda: w4a16_deq_matmul(x, w, out),
           "dot": lambda: w4a16_dot(x, w, out, w_left=a.left)}
    for _ in range(4):
        fns[a.kernel]()
    torch.cuda.synchronize()
    print(f"{a.kernel} m={a.m} k={a.k} n={a.n}: done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
