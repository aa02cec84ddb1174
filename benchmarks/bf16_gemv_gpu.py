"""The bf16 decode GEMV (kernels/dense_gemv.py) on one GPU: per-shape time vs cuBLAS, and the
engine's batch-1 decode with the route on and off, in one run (< 4 minutes on an H200).

    python3 benchmarks/bf16_gemv_gpu.py [--quick] [--sweep] [--json OUT.json]

Sections:
  kernels  Llama-3.1-8B step shapes at 1 (and 4) rows, weights cycled past the L2 inside a CUDA
           graph (gpu_timing.graph_ms): ours (qkv and gate_up with the norm + residual prologue,
           gate_up with the SiLU epilogue) vs the unfused ops it replaces (add_rms_norm kernel +
           cuBLAS + silu_and_mul) vs the cuBLAS matmul alone, each as % of the copy rate, plus
           the max row-relative error of ours vs the unfused ops
  sweep    (--sweep, a few minutes more) tiles per shape at 1 row (--sweep-rows M,...): block_n x
           block_k x num_warps x num_stages, and split 1 / 4 for the plain shapes (compiles in parallel
           first); prints the best row for tuning.DENSE_GEMV_TABLE
  engine   dummy Llama-3.1-8B bf16: batch-1 (and batch-4) decode tok/s with CUDA graphs, with
           HOMELAB_LLM_DENSE_GEMV=0 (cuBLAS + separate norm/silu kernels) and =1 (the GEMV
           route); logits of a 1-token and a 4-token prompt (the routed row counts) of both
           engines compared (same dummy weights: seeded per tensor name); the graph replay's
           GPU time per batch-1 step (llama8b_<route>_b1_graph_gpu_ms; 232 tok/s needs <= 4.31)
  profile  (--profile) kernels and launches per eager batch-1 step, route off and on
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from engine_gpu import (cleanup, decode_rate, host_vs_graph, make_engine,  # noqa: E402
                        profile_decode_steps, random_prompt)
from gpu_harness import report, results, run_sections  # noqa: E402
from gpu_timing import copies_for, copy_rate_gbs, default_jobs, graph_ms, precompile  # noqa: E402

from homelab_llm.engine.kernels import elementwise  # noqa: E402
from homelab_llm.engine.kernels.dense_gemv import dense_gemv  # noqa: E402
from homelab_llm.engine.sampling_params import SamplingParams  # noqa: E402

# name, weight rows N, K, what the engine fuses into it
SHAPES = [("qkv", 6144, 4096, "norm"), ("o", 4096, 4096, "plain"),
          ("gate_up", 28672, 4096, "gated"), ("down", 4096, 14336, "plain")]
ENV = "HOMELAB_LLM_DENSE_GEMV"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1).clamp_min(1e-30)).max())


class Shape:
    """One step linear's weights (enough copies to overflow the L2) and its inputs at m rows."""

    def __init__(self, n: int, k: int, kind: str, m: int, dev: torch.device,
                 copies: int | None = None):
        self.kind, self.bytes = kind, n * k * 2
        self.copies = copies or copies_for(self.bytes, cap=8)
        gen = torch.Generator(device=dev).manual_seed(n + k)
        self.w = [torch.randn((n, k), generator=gen, device=dev, dtype=torch.bfloat16) * k ** -0.5
                  for _ in range(self.copies)]
        self.x = torch.randn((m, k), generator=gen, device=dev, dtype=torch.bfloat16)
        self.res = torch.randn((m, k), generator=gen, device=dev, dtype=torch.bfloat16)
        self.nw = torch.rand(k, generator=gen, device=dev, dtype=torch.bfloat16) + 0.5

    def ours(self, i: int, **tiles) -> torch.Tensor:
        if self.kind == "plain":
            return dense_gemv(self.x, self.w[i], **tiles)[0]
        return dense_gemv(self.x, self.w[i], norm_weight=self.nw, eps=1e-5, residual=self.res,
                          gated=self.kind == "gated", **tiles)[0]

    def unfused(self, i: int) -> torch.Tensor:
        if self.kind == "plain":
            return F.linear(self.x, self.w[i])
        h, _ = elementwise.add_rms_norm(self.x, self.res, self.nw, 1e-5)
        out = F.linear(h, self.w[i])
        return elementwise.silu_and_mul(out) if self.kind == "gated" else out

    def pct(self, ms: float) -> float:
        return 100.0 * self.bytes / ms / 1e6 / results["gemv_copy_rate_GBps"]


def section_kernels(quick: bool) -> None:
    dev = torch.device("cuda")
    report("gemv_copy_rate_GBps", copy_rate_gbs(dev), "GB/s")
    print(f"{'shape':10s} {'rows':>4s} {'ours ms':>8s} {'%copy':>6s} {'unfused':>8s} {'cuBLAS':>8s} "
          f"{'%copy':>6s} {'max rel err':>11s}", flush=True)
    total = {"ours": 0.0, "unfused": 0.0}
    for m in (1,) if quick else (1, 4):
        for name, n, k, kind in SHAPES:
            s = Shape(n, k, kind, m, dev)
            ours, unfused = graph_ms(s.ours, s.copies), graph_ms(s.unfused, s.copies)
            blas = graph_ms(lambda i: F.linear(s.x, s.w[i]), s.copies)
            err = _rel(s.ours(0), s.unfused(0))
            print(f"{name:10s} {m:4d} {ours:8.4f} {s.pct(ours):6.1f} {unfused:8.4f} {blas:8.4f} "
                  f"{s.pct(blas):6.1f} {err:11.2e}", flush=True)
            report(f"gemv_{name}_m{m}_pct_copy", s.pct(ours), "%")
            report(f"gemv_{name}_m{m}_cublas_pct_copy", s.pct(blas), "%")
            report(f"gemv_{name}_m{m}_rel_err_vs_unfused", err)
            if m == 1:
                total["ours"] += ours
                total["unfused"] += unfused
            cleanup()
    # 32 layers of the four linears (plus the ops fused into them): the step's GEMV share
    report("gemv_8b_layers_ms_ours_m1", 32 * total["ours"], "ms")
    report("gemv_8b_layers_ms_unfused_m1", 32 * total["unfused"], "ms")


def _sweep_variants(kind: str) -> list[dict]:
    """Tiles x warps x stages (1: plain loads, one K step at a time; more: the K loop's word
    loads streamed through shared memory) at the table's split, then splits 1 and 4 (plain)."""
    tiles = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st) for bn, bk, w, st in
             itertools.product((1, 2, 4, 8, 16), (256, 512, 1024), (2, 4, 8), (1, 3))]
    if kind == "plain":
        tiles += [dict(block_n=16, block_k=512, num_warps=4, split=sp) for sp in (1, 4)]
    return tiles


def compile_variant(n: int, k: int, kind: str, tiles: dict, m: int = 1) -> None:
    """A precompile worker: one call of the variant at the sweep's shape (fills Triton's cache)."""
    Shape(n, k, kind, m, torch.device("cuda"), copies=1).ours(0, **tiles)
    torch.cuda.synchronize()


def section_sweep(rows: tuple[int, ...] = (1,)) -> None:
    dev = torch.device("cuda")
    if "gemv_copy_rate_GBps" not in results:
        report("gemv_copy_rate_GBps", copy_rate_gbs(dev), "GB/s")
    jobs = [(n, k, kind, t, m) for m in rows for _, n, k, kind in SHAPES for t in _sweep_variants(kind)]
    print(f"precompiling {len(jobs)} variants: {precompile(compile_variant, jobs, default_jobs()):.0f} s",
          flush=True)
    for m, (name, n, k, kind) in itertools.product(rows, SHAPES):
        s = Shape(n, k, kind, m, dev)
        timed = []
        for tiles in _sweep_variants(kind):
            try:
                timed.append((graph_ms(lambda i: s.ours(i, **tiles), s.copies), tiles))
            except Exception as exc:  # e.g. out of registers/shared memory: skip the config
                print(f"  {name} {tiles}: {type(exc).__name__}", flush=True)
        timed.sort(key=lambda row: row[0])
        for ms, tiles in timed[:5]:
            print(f"  {name:8s} m{m} {tiles} {ms:.4f} ms = {s.pct(ms):.1f}% of copy", flush=True)
        if timed:
            ms, tiles = timed[0]
            print(f"sweep {name:8s} m{m} best {tiles} {ms:.4f} ms = {s.pct(ms):.1f}% of copy",
                  flush=True)
            report(f"sweep_{name}_m{m}_best_pct_copy", s.pct(ms), "%")
        cleanup()


def _logits(engine, prompt: list[int], request_id: str) -> torch.Tensor:
    """Last-position logits of one prompt through the runner (as engine_gpu's check does)."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1))
    plan = engine.scheduler.schedule()
    out = engine.runner.forward(engine.runner.prepare(plan.scheduled))[-1].float().cpu()
    engine.abort_request(request_id)
    return out


def section_engine(quick: bool) -> None:
    logits = {}
    for route in ("0", "1"):
        os.environ[ENV] = route  # read at every dispatch; graphs capture what was on at build
        label = "gemv" if route == "1" else "cublas"
        engine = make_engine("Llama-3.1-8B.json", max_model_len=2048, max_num_seqs=8)
        decode_rate(engine, 1, 32, 16)  # warm up
        report(f"llama8b_bf16_b1_tok_s_{label}", decode_rate(engine, 1, 32, 128 if quick else 256),
               "tok/s")
        if not quick:
            report(f"llama8b_bf16_b4_tok_s_{label}", decode_rate(engine, 4, 32, 128), "tok/s")
        # the graph replay's GPU time per batch-1 step (reported as llama8b_<label>_b1_graph_gpu_ms)
        host_vs_graph(engine, list(range(100, 132)), f"llama8b_{label}", steps=100, top=3)
        # last: the check schedules outside step() and aborts its requests; flush the aborted
        # request's in-flight step first
        for _ in range(3):
            engine.step()
        rng = random.Random(5)
        vocab = engine.model_config.vocab_size
        try:
            logits[label] = [_logits(engine, random_prompt(n, vocab, rng), f"check{n}")
                             for n in (1, 4)]
        except Exception as exc:  # keep the other route's numbers
            print(f"logits check on {label} failed: {type(exc).__name__}: {exc}", flush=True)
        del engine
        cleanup()
    os.environ.pop(ENV, None)
    for i, rows in enumerate((1, 4) if len(logits) == 2 else ()):
        a, b = logits["gemv"][i], logits["cublas"][i]
        report(f"llama8b_logits_rel_err_gemv_vs_cublas_{rows}tok", _rel(a, b))
        report(f"llama8b_top1_match_{rows}tok", float(int(a.argmax()) == int(b.argmax())))
    report("llama8b_bf16_b1_speedup", results["llama8b_bf16_b1_tok_s_gemv"]
           / results["llama8b_bf16_b1_tok_s_cublas"], "x")


def section_profile() -> None:
    """Kernels and launches per eager batch-1 step, route off then on (graphs off: every launch
    is visible)."""
    for route, label in (("0", "cublas"), ("1", "gemv")):
        os.environ[ENV] = route
        engine = make_engine("Llama-3.1-8B.json", max_model_len=2048, enforce_eager=True,
                             max_num_seqs=4)
        report(f"llama8b_eager_step_gpu_kernel_us_{label}",
               profile_decode_steps(engine, list(range(100, 132)), label, top=12), "us")
        del engine
        cleanup()
    os.environ.pop(ENV, None)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="1 row only, shorter decode runs")
    p.add_argument("--sweep", action="store_true", help="also sweep tiles per shape (minutes)")
    p.add_argument("--sweep-rows", default="1", help="activation rows the sweep times (comma list)")
    p.add_argument("--profile", action="store_true",
                   help="also list kernels and launches per eager step, route off and on (~1 min)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    rows = tuple(int(r) for r in a.sweep_rows.split(","))
    sections = {"kernels": lambda: section_kernels(a.quick), "sweep": lambda: section_sweep(rows),
                "engine": lambda: section_engine(a.quick), "profile": section_profile}
    names = ",".join(["kernels"] + ["sweep"] * a.sweep + ["engine"] + ["profile"] * a.profile)
    return run_sections(sections, names, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
