"""Where a W4A16 batch-1 decode step goes, runnable against any checkout of this repository.

    python3 benchmarks/w4a16_regress.py [--root DIR] [--config Llama-3.1-8B.json] [--eager-profile]
        [--kv-cache-dtype int8] [--profile-batch 8]

Builds the dummy W4A16 engine from the checkout at --root (default: this one), then prints one
line each: batch-1 decode tok/s over 128 tokens with graphs, the graph replay's GPU time per step
(CUDA events around DecodeGraphs.run) and the wall time per step; with --eager-profile, the top
kernels of an eager step. Uses only the engine API that every checkout since the W4A16 GEMV has,
so two checkouts can be compared in one device run (bisecting a regression).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_harness import ReplayTimer, eager_kernel_totals, request_ids  # noqa: E402


def make_engine(config: str, quant: str = "w4a16", **kw):
    """The dummy-weight engine of assets/model_configs/`config` on cuda in bf16 (quant "none":
    bf16 weights); `kw` overrides EngineArgs (enforce_eager=True for profiling)."""
    from homelab_llm.assets import assets_dir
    from homelab_llm.engine.args import EngineArgs
    from homelab_llm.engine.core import LLMEngine

    args = dict(model=str(assets_dir() / "model_configs" / config), load_format="dummy",
                device="cuda", dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=2048,
                gpu_memory_utilization=0.4, max_model_len=4096,
                quantization=None if quant == "none" else quant)
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


def eager_kernels(eng, prompt: list[int], steps: int = 16,
                  batch: int = 1) -> list[tuple[float, float, str]]:
    """(us a step, launches a step, kernel name) of decode steps of `batch` requests on an eager
    engine, most time first."""
    totals = eager_kernel_totals(eng, prompt, "p", steps, batch)
    for rid in request_ids("p", batch):
        eng.abort_request(rid)
    return sorted(((us, count, name) for name, (us, count) in totals.items()), reverse=True)


def graph_decode(eng, prompt: list[int], tokens: int, prof=None,
                 out_ids: list[int] | None = None, batch: int = 1) -> tuple[float, float, int]:
    """(wall ms a step, graph GPU ms a replay of all `batch` rows, such replays) of a greedy decode
    of `tokens` by `batch` requests after a 16-token warm-up, the first (prefill) step of each left
    out (a prompt longer than a step's token budget prefills in chunks: those steps are in the
    wall time, and requests start decoding steps apart, so ask for more tokens than that); `prof` (a
    cProfile.Profile) is enabled over the timed steps; `out_ids` receives the first timed
    request's tokens."""
    import torch

    from homelab_llm.engine.sampling_params import SamplingParams

    timer = ReplayTimer(eng.runner.graphs)
    first_run = request_ids("run", batch)[0]
    for rid, n in (("warm", 16), ("run", tokens)):
        for req in request_ids(rid, batch):
            eng.add_request(req, prompt, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
        steps = 0
        while eng.has_unfinished_requests():
            if steps == 1:
                torch.cuda.synchronize()
                timer.events.clear()
                t = time.perf_counter()
                if prof is not None and rid == "run":
                    prof.enable()
            for out in eng.step():
                if out_ids is not None and out.request_id == first_run:
                    out_ids.extend(out.new_token_ids)
            steps += 1
        torch.cuda.synchronize()
    if prof is not None:
        prof.disable()
    wall = (time.perf_counter() - t) / (steps - 1) * 1e3
    gpu, replays = timer.mean_ms(batch), len(timer.timed(batch))
    timer.restore()
    return wall, gpu, replays


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    p.add_argument("--config", default="Llama-3.1-8B.json")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--eager-profile", action="store_true")
    p.add_argument("--profile-batch", type=int, default=1, help="requests in the eager profile")
    p.add_argument("--batch", type=int, default=1, help="requests in the timed graph decode")
    p.add_argument("--prompt-len", type=int, default=32,
                   help="prompt tokens of every request (past 32: prefix caching off, so each "
                        "request reads its own KV as distinct prompts would)")
    p.add_argument("--label", default="")
    p.add_argument("--quant", default="w4a16", help="quantization (w4a16) or none (bf16)")
    p.add_argument("--cprofile", action="store_true", help="cProfile the timed steps (top by tottime)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto or int8 (the reference deployment)")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="the engine's --quantize-lm-head (logits from a 4-bit head)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                   help="0.85 for bf16 weights past ~50 GB (the 30B-A3B: 61 GB)")
    a = p.parse_args()
    sys.path.insert(0, a.root)
    import torch

    label = a.label or Path(a.root).name

    def engine(**kw):
        if a.prompt_len > 32:
            kw.setdefault("enable_prefix_caching", False)
        if a.quantize_lm_head:
            kw["quantize_lm_head"] = True
        # every request of --batch in one step (the engine's default 8 ran 16 / 32 as rounds of 8)
        kw.setdefault("max_num_seqs", max(8, a.batch, a.profile_batch))
        kw.setdefault("max_model_len", max(4096, a.prompt_len + a.tokens + 32))
        return make_engine(a.config, a.quant, kv_cache_dtype=a.kv_cache_dtype,
                           gpu_memory_utilization=a.gpu_memory_utilization, **kw)

    import cProfile
    import pstats

    prof = cProfile.Profile()
    prompt = [100 + i % 1000 for i in range(a.prompt_len)]
    eng = engine()
    ids: list[int] = []
    wall, gpu, replays = graph_decode(eng, prompt, a.tokens, prof if a.cprofile else None, ids,
                                      a.batch)
    # the tokens' digest: kernel changes that keep the arithmetic (launch attributes, tiles of
    # deterministic kernels) must keep it bit for bit
    digest = hashlib.sha256(repr(ids).encode()).hexdigest()[:12]
    print(f"REGRESS {label}: b{a.batch} {a.batch * 1e3 / wall:.1f} tok/s, wall {wall:.3f} ms/step, graph GPU "
          f"{gpu:.3f} ms/step over {replays} replays, tokens {digest}", flush=True)
    if a.cprofile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    if a.eager_profile:
        rows = eager_kernels(engine(enforce_eager=True), prompt, batch=a.profile_batch)
        print(f"REGRESS {label}: batch {a.profile_batch} eager step kernels {sum(r[0] for r in rows):.0f} us, "
              f"{sum(r[1] for r in rows):.0f} launches", flush=True)
        for us, count, name in rows[:20]:
            print(f"  {us:8.1f} us {count:6.1f}/step {name[:90]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
