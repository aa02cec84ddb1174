"""TP=2 shutdown on a GPU pair (issue #5): build, decode (CUDA graphs), shut down, build again.

    python benchmarks/tp_shutdown_gpu.py; echo "exit code $?"

Qwen3-0.6B shape, dummy bf16 weights, one engine per all-reduce mode (auto: the peer-buffer
kernel, then nccl) in the same process. Prints per engine: decode tok/s, graphs destroyed,
shutdown seconds and phases, worker exit codes. Passes when every shutdown takes < 2 s, no
teardown got stuck, every worker left with 0, and the process then exits 0 (no "terminate
called" at interpreter exit).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def main() -> int:
    import torch

    from engine_gpu import decode_rate, make_engine
    from homelab_llm.engine.parallel import shutdown as tp_shutdown

    ok = True
    for mode in ("auto", "nccl"):
        os.environ["HOMELAB_ALLREDUCE"] = mode  # workers inherit it
        t0 = time.monotonic()
        engine = make_engine("Qwen3-0.6B.json", max_model_len=1024, tensor_parallel_size=2,
                             max_num_seqs=8, gpu_memory_utilization=0.15)
        runner = engine.runner
        built = time.monotonic() - t0
        rate = decode_rate(engine, 2, 16, 32)
        graphs = len(runner.local.graphs.graphs) if runner.local.graphs is not None else 0
        engine.shutdown()
        phases = ", ".join(f"{k} {v:.3f}" for k, v in runner.shutdown_phases.items())
        codes = [p.exitcode for p in runner.procs]
        stuck = any(t.is_alive() for t in tp_shutdown._stuck_teardowns)
        good = runner.shutdown_seconds < 2.0 and codes == [0] and not stuck and graphs > 0
        ok = ok and good
        print(f"tp2 {mode}: built {built:.1f} s, decode {rate:.0f} tok/s, {graphs} graphs; "
              f"shutdown {runner.shutdown_seconds:.3f} s ({phases}); workers {codes}; "
              f"stuck {stuck} -> {'OK' if good else 'FAIL'}", flush=True)
        del engine, runner
        torch.cuda.empty_cache()
    print(f"tp_shutdown: {'PASS' if ok else 'FAIL'} (now exiting; expect exit code {0 if ok else 1})",
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(var, value)
    raise SystemExit(main())
