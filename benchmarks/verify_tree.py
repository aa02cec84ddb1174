"""The Qwen3.6-27B W4A16 verify forward (spec_gpu.py's `verify`) from any checkout of this
repository, to bisect a regression across trees in one device call:

    git archive REV homelab_llm assets benchmarks | tar -x -C .trees/REV
    python3 benchmarks/verify_tree.py .trees/REV [--ks 1,2] [--config Qwen3.6-27B.json]

Imports spec_gpu and homelab_llm from ROOT (not this checkout) and prints that tree's plain and
verify step times at batch 1 and 8 (docs/BENCHMARKS.md 16.2).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--ks", default="1,2", help="draft lengths K besides the plain step")
    p.add_argument("--config", default="Qwen3.6-27B.json")
    p.add_argument("--quant", default="w4a16", help="w4a16 or none")
    a = p.parse_args()
    root = Path(a.root).resolve()
    sys.path[:0] = [str(root), str(root / "benchmarks")]
    import spec_gpu

    import homelab_llm

    spec_gpu.VERIFY_KS = [int(k) for k in a.ks.split(",")]
    spec_gpu.QUICK = True
    print(f"tree {root}: spec_gpu {spec_gpu.__file__}, homelab_llm {homelab_llm.__file__}", flush=True)
    # trees before 2026-12-02 (session 10) named it _verify_model
    verify_model = getattr(spec_gpu, "verify_model", None) or getattr(spec_gpu, "_verify_model")
    with tempfile.TemporaryDirectory() as folder:
        verify_model(a.config, None if a.quant == "none" else a.quant, Path(folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
