"""Fused MoE on one GPU at the Qwen3-30B-A3B expert shape (128 experts, top 8, hidden 2048, expert
width 768; --tp 2 halves the width as one rank of TP=2 holds it).

    python3 benchmarks/moe_gpu.py [--quick] [--tp 2] [--json out.json]

Sections (each reports even if another fails):
  check    full-shape correctness of moe_align, the bf16 and W4A16 fused paths and the combine
           against the torch references (kernels/moe_ref.py), relative Frobenius error
  layer    (moe_layer_gpu.py) one whole MoE layer, router + experts, batch 1 and 8, bf16 and
           W4A16, old path vs new (route_gate_topk + fused_moe_decode), experts read from HBM:
           microseconds and % of the copy rate of the active bytes
  decode   batch 1 / 8 / 32 of the experts alone, bf16 and W4A16, timed inside a CUDA graph: the
           expert bytes the batch's picks imply (each distinct active expert read once) over the
           time, as a share of the measured copy bandwidth (the roofline); the torch
           grouped-GEMM loop (moe_experts_ref: one matmul per active expert) timed beside it.
           Same picks every replay, so the active experts sit in the L2: `layer` is the honest one
  prefill  2,048 tokens, bf16 and W4A16: FLOP/s over the measured bf16 matmul rate, the torch
           loop, and for bf16 torch._grouped_mm over expert-sorted slots (the peer)
  router   the one-launch Triton router (moe_router.py) vs torch softmax + topk, b1/b8, in a graph;
           and with the gate matmul: cuBLAS + the router vs route_gate_topk (one launch)
  sweep    (not default) decode b1/b8 and prefill under a few tile variants, to pick the
           tuning.py entries (fused_moe uses the table's gemv/gemm rows today; dense experts at
           prefill also (gate_up, down) tile pairs with gate and up in one dot, the moe_gemm
           entry), and the W4A16 decode GEMV (fused_moe_gemv.py, the table's gemv_rows today)
           under block_n/rows/warps
Decode (b <= 8) runs fused_moe_decode; `decode.KIND.bN.gemv_path_ms` / `gemm_path_ms` are the
older paths (fused_moe(..., decode="gemv" / "gemm")) timed in the same run.
  engine   the whole Qwen3-30B-A3B (assets/model_configs, dummy W4A16 weights) through LLMEngine:
           batch-1 and batch-8 decode tok/s, and the batch-1 roofline from the bytes one token
           reads (all weights but the 120 unpicked experts per layer and the embedding table)
  launches the same model eager at batch 1: kernel launches per decode step, all and MoE ones
  profile  (not default) the same model at batch 1: graph GPU time vs wall time per step and the
           host functions between, then the eager step's kernels by GPU time; profile_bf16 the
           same for the bf16 model
  prefill_kernels (not default) the prefill layer's kernels one by one (torch profiler)
  sweep_decode (not default) fused_moe_decode and the fused router under tile variants
The issue-15 decode numbers in one run (< 4 min on an H200):
    python3 benchmarks/moe_gpu.py --quick --sections check,layer,engine,launches
Targets (issue 15): decode b1 >= 50% of the active-bytes roofline; prefill >= 50% of the matmul
rate. Routing is random (softmax of N(0, 1) logits), so experts are spread about evenly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_harness import profile_totals, report, run_sections  # noqa: E402
from homelab_llm.engine.kernels.fused_moe import fused_moe, w4_decode  # noqa: E402
from homelab_llm.engine.kernels.moe_align import moe_align  # noqa: E402
from homelab_llm.engine.kernels.moe_ref import (  # noqa: E402
    MoeW4,
    moe_align_ref,
    moe_experts_ref,
    route_topk_ref,
)
from homelab_llm.engine.kernels.w4a16_pack import W4Weight  # noqa: E402
from moe_layer_gpu import section_launches, section_layer, section_sweep_decode  # noqa: E402

E, TOP_K, HIDDEN, INTER, GROUP = 128, 8, 2048, 768, 128
ENGINE_CONFIG = "Qwen3-30B-A3B.json"  # the assets/model_configs entry the engine section runs
DEV = torch.device("cuda")


def bench_graph(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=50))


def bench_eager(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=3, rep=30, return_mode="median"))


def peak_copy_gbps() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    return 2 * x.numel() / bench_eager(lambda: y.copy_(x)) / 1e6


def peak_matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / bench_eager(lambda: a @ b) / 1e9


class Setup:
    def __init__(self, inter: int):
        gen = torch.Generator(device=DEV).manual_seed(0)
        self.inter = inter
        self.w13 = (torch.randn(E, 2 * inter, HIDDEN, device=DEV, generator=gen) * 0.02).bfloat16()
        self.w2 = (torch.randn(E, HIDDEN, inter, device=DEV, generator=gen) * 0.02).bfloat16()
        self.w4 = MoeW4(self._w4(HIDDEN, 2 * inter, gen), self._w4(inter, HIDDEN, gen))

    @staticmethod
    def _w4(k: int, n: int, gen) -> W4Weight:
        q = torch.randint(-(2 ** 31), 2 ** 31, (E, k // 8, n), device=DEV, generator=gen,
                          dtype=torch.int64).to(torch.int32)
        s = ((torch.rand(E, k // GROUP, n, device=DEV, generator=gen) + 0.5) * 0.005).half()
        return W4Weight(q, s, (-8.0 * s.float()).half(), GROUP)

    def expert_bytes(self, w4: bool) -> int:
        return self.expert_bytes_of(self.inter, w4)

    @staticmethod
    def expert_bytes_of(inter: int, w4: bool) -> int:
        """Bytes of one expert's gate_up + down weights (4-bit: nibbles + fp16 scales, biases)."""
        params = 3 * HIDDEN * inter
        if not w4:
            return params * 2
        return params // 2 + (HIDDEN // GROUP * 2 * inter + inter // GROUP * HIDDEN) * 4

    def layers(self) -> dict:
        """The moe_layer_gpu sections' view of the experts, bf16 and W4A16."""
        from moe_layer_gpu import Layer

        return {kind: Layer(w13, w2, self.expert_bytes(kind == "w4a16"), E, TOP_K, HIDDEN)
                for kind, w13, w2 in (("bf16", self.w13, self.w2), ("w4a16", self.w4, None))}

    def batch(self, tokens: int, seed: int = 1):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        x = torch.randn(tokens, HIDDEN, device=DEV, generator=gen).bfloat16()
        logits = torch.randn(tokens, E, device=DEV, generator=gen)
        weights, ids = route_topk_ref(logits, TOP_K, renormalize=True)
        return x, weights, ids


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def section_check(setup: Setup, quick: bool) -> None:
    for tokens in (1, 8, 32) if quick else (1, 8, 32, 2048):
        x, weights, ids = setup.batch(tokens)
        got_align = moe_align(ids, E, 16)
        want_align = moe_align_ref(ids, E, 16)
        report(f"check.align.t{tokens}.exact", float(all(torch.equal(a, b) for a, b in
                                                         zip(got_align, want_align))))
        bf16 = rel_err(fused_moe(x, setup.w13, setup.w2, weights, ids),
                       moe_experts_ref(x, setup.w13, setup.w2, weights, ids))
        report(f"check.bf16.t{tokens}.rel_err", bf16, "(bound 2e-2)")
        want_w4 = moe_experts_ref(x, setup.w4, None, weights, ids)
        w4 = rel_err(fused_moe(x, setup.w4, None, weights, ids), want_w4)
        report(f"check.w4a16.t{tokens}.rel_err", w4, "(bound 2e-2)")
        if tokens <= 8:
            for path in ("gemv", "gemm"):
                old = rel_err(fused_moe(x, setup.w4, None, weights, ids, decode=path), want_w4)
                report(f"check.w4a16_{path}_path.t{tokens}.rel_err", old, "(bound 2e-2)")
            again = torch.equal(fused_moe(x, setup.w4, None, weights, ids),
                                fused_moe(x, setup.w4, None, weights, ids))
            report(f"check.w4a16.t{tokens}.repeat_bitwise_equal", float(again), "(must be 1)")


def grouped_mm_experts(x, w13, w2, weights, ids) -> torch.Tensor:
    """The peer at prefill sizes for dense experts: torch._grouped_mm (CUTLASS grouped GEMM on
    sm_90) over the slots sorted by expert, SiLU-and-mul and the weighted combine in torch."""
    t, top_k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device)  # no host sync
    offs = counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
    gate_up = torch._grouped_mm(x[order // top_k], w13.transpose(1, 2), offs=offs)
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    out = torch.empty_like(y)
    out[order] = y
    return (out.view(t, top_k, -1).float() * weights.float()[..., None]).sum(1).to(x.dtype)


def _timings(setup: Setup, tokens: int, w4: bool) -> tuple[float, float]:
    x, weights, ids = setup.batch(tokens)
    w13, w2 = (setup.w4, None) if w4 else (setup.w13, setup.w2)
    ours = bench_graph(lambda: fused_moe(x, w13, w2, weights, ids))
    loop = bench_eager(lambda: moe_experts_ref(x, w13, w2, weights, ids))
    return ours, loop


def section_decode(setup: Setup, quick: bool, copy_gbps: float) -> None:
    for w4 in (False, True):
        kind = "w4a16" if w4 else "bf16"
        w13, w2 = (setup.w4, None) if w4 else (setup.w13, setup.w2)
        for tokens in (1, 8) if quick else (1, 8, 32):
            _, _, ids = setup.batch(tokens)
            active = len(torch.unique(ids))
            nbytes = active * setup.expert_bytes(w4)
            ours, loop = _timings(setup, tokens, w4)
            roof_ms = nbytes / copy_gbps / 1e6
            report(f"decode.{kind}.b{tokens}.ms", ours)
            report(f"decode.{kind}.b{tokens}.active_experts", active)
            report(f"decode.{kind}.b{tokens}.GBps", nbytes / ours / 1e6, "GB/s of expert weights")
            report(f"decode.{kind}.b{tokens}.pct_roofline", 100 * roof_ms / ours, "% (target >= 50 at b1)")
            report(f"decode.{kind}.b{tokens}.layer_tok_s", tokens / ours * 1e3, "tok/s through one layer")
            report(f"decode.{kind}.b{tokens}.torch_loop_ms", loop)
            for path in (("gemv", "gemm") if w4 else ("gemm",)) if tokens <= 8 else ():
                x, weights, ids = setup.batch(tokens)
                old = bench_graph(lambda: fused_moe(x, w13, w2, weights, ids, decode=path))
                report(f"decode.{kind}.b{tokens}.{path}_path_ms", old,
                       f"older {path} path: {100 * roof_ms / old:.1f}% of roofline")


def section_router(quick: bool) -> None:
    from homelab_llm.engine.kernels.moe_router import route_gate_topk, route_topk

    for tokens in (1, 8, 32):
        # fp32 logits for the id check: bf16 randn over 128 experts ties often, and the two
        # break ties differently (ours: lowest id).
        exact = torch.randn(tokens, E, device=DEV)
        got, want = route_topk(exact, TOP_K, True), route_topk_ref(exact, TOP_K, True)
        report(f"router.b{tokens}.ids_equal_fp32", float(torch.equal(got[1].sort(-1).values,
                                                                      want[1].sort(-1).values)))
        logits = exact.bfloat16()
        report(f"router.b{tokens}.triton_ms", bench_graph(lambda: route_topk(logits, TOP_K, True)))
        report(f"router.b{tokens}.torch_ms",
               bench_graph(lambda: route_topk_ref(logits, TOP_K, True)))
        if tokens <= 8:  # the gate matmul too: cuBLAS + the router kernel vs the fused launch
            x = torch.randn(tokens, HIDDEN, device=DEV).bfloat16()
            gate = (torch.randn(E, HIDDEN, device=DEV) * 0.02).bfloat16()
            report(f"router.b{tokens}.gate_cublas_then_triton_ms",
                   bench_graph(lambda: route_topk(x @ gate.T, TOP_K, True)))
            report(f"router.b{tokens}.gate_fused_ms",
                   bench_graph(lambda: route_gate_topk(x, gate, TOP_K, True)))


def section_prefill(setup: Setup, quick: bool, mm_tflops: float) -> None:
    tokens = 1024 if quick else 2048
    flops = 2 * tokens * TOP_K * 3 * HIDDEN * setup.inter
    for w4 in (False, True):
        kind = "w4a16" if w4 else "bf16"
        ours, loop = _timings(setup, tokens, w4)
        report(f"prefill.{kind}.t{tokens}.ms", ours)
        report(f"prefill.{kind}.t{tokens}.TFLOPs", flops / ours / 1e9)
        report(f"prefill.{kind}.t{tokens}.pct_matmul", 100 * flops / ours / 1e9 / mm_tflops,
               "% of bf16 matmul (target >= 50)")
        report(f"prefill.{kind}.t{tokens}.torch_loop_ms", loop)
    if hasattr(torch, "_grouped_mm"):  # bf16: torch's grouped GEMM, the strongest peer here
        x, weights, ids = setup.batch(tokens)
        args = (x, setup.w13, setup.w2, weights, ids)
        err = rel_err(grouped_mm_experts(*args), fused_moe(*args))
        ms = bench_graph(lambda: grouped_mm_experts(*args))
        report(f"prefill.bf16.t{tokens}.torch_grouped_mm_ms", ms,
               f"{100 * flops / ms / 1e9 / mm_tflops:.1f}% of matmul, {err:.1e} from ours")


def section_prefill_kernels(setup: Setup, quick: bool, mm_tflops: float) -> None:
    """The prefill layer's kernels one by one (torch profiler, eager, 5 calls): where the time of
    `prefill` goes, and each GEMM's FLOP/s over the matmul rate."""
    from torch.profiler import ProfilerActivity, profile

    tokens = 1024 if quick else 2048
    for w4 in (False, True):
        kind = "w4a16" if w4 else "bf16"
        w13, w2 = (setup.w4, None) if w4 else (setup.w13, setup.w2)
        x, weights, ids = setup.batch(tokens)
        for _ in range(3):
            fused_moe(x, w13, w2, weights, ids)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fused_moe(x, w13, w2, weights, ids)
            torch.cuda.synchronize()
        for name, (us, count) in sorted(profile_totals(prof, 5).items(), key=lambda kv: -kv[1][0]):
            print(f"  prefill_kernels.{kind}.t{tokens}: {us:8.1f} us {count:4.1f}/call  {name[:80]}",
                  flush=True)
    report("prefill_kernels.matmul_TFLOPs", mm_tflops,
           f"gate_up {2 * tokens * TOP_K * 2 * HIDDEN * setup.inter / 1e9:.1f} GFLOP, "
           f"down {2 * tokens * TOP_K * HIDDEN * setup.inter / 1e9:.1f}")


def section_engine(quick: bool, copy_gbps: float, quantization: str | None) -> None:
    import random
    import time

    from homelab_llm.engine.args import EngineArgs
    from homelab_llm.engine.core import LLMEngine
    from homelab_llm.engine.sampling_params import SamplingParams

    kind = quantization or "bf16"
    config = Path(__file__).resolve().parents[1] / "assets" / "model_configs" / ENGINE_CONFIG
    engine = LLMEngine(EngineArgs(model=str(config), load_format="dummy", device="cuda",
                                  dtype="bfloat16", quantization=quantization, max_model_len=4096,
                                  max_num_seqs=8, max_num_batched_tokens=2048,
                                  gpu_memory_utilization=0.85))
    status = engine.status()
    weights = status["devices"][0]["weights"]
    expert = Setup.expert_bytes_of(INTER, quantization == "w4a16")
    layers = engine.model_config.num_hidden_layers
    active = weights - layers * (E - TOP_K) * expert - engine.model_config.vocab_size * HIDDEN * 2
    report(f"engine.{kind}.weights_GB", weights / 1e9)
    report(f"engine.{kind}.active_params", status["config"]["active_parameters"])
    report(f"engine.{kind}.b1_roofline_tok_s", copy_gbps * 1e9 / active)
    rng = random.Random(0)
    for batch in (1, 8):
        for i in range(batch):
            prompt = [rng.randrange(10, 150000) for _ in range(32)]
            engine.add_request(f"{kind}{batch}-{i}", prompt,
                               SamplingParams(max_tokens=64 if quick else 128, ignore_eos=True))
        engine.step()  # prefill
        torch.cuda.synchronize()
        start, produced = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            produced += sum(len(out.new_token_ids) for out in engine.step())
        torch.cuda.synchronize()
        report(f"engine.{kind}.b{batch}_decode_tok_s", produced / (time.perf_counter() - start))
    del engine


SWEEP_TILES = [  # (block_m, block_n, block_k, num_warps, num_stages)
    (16, 32, 128, 4, 3), (16, 64, 128, 4, 3), (16, 64, 64, 4, 4), (16, 128, 64, 4, 3),
    (16, 64, 256, 8, 2), (32, 64, 128, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3),
    (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 64, 4, 3), (128, 128, 64, 8, 4),
    (64, 256, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 128, 4, 3), (128, 64, 64, 4, 3),
    (128, 128, 128, 8, 3), (64, 64, 128, 4, 4),
]


def section_sweep(setup: Setup, quick: bool) -> None:
    from homelab_llm.engine.kernels.tuning import GemmTiles

    for tokens in (1, 8, 2048):
        x, weights, ids = setup.batch(tokens)
        for w4 in (False, True):
            kind = "w4a16" if w4 else "bf16"
            w13, w2 = (setup.w4, None) if w4 else (setup.w13, setup.w2)
            want = fused_moe(x, w13, w2, weights, ids)
            for bm, bn, bk, warps, stages in SWEEP_TILES:
                if (tokens < 64) != (bm <= 32):
                    continue
                _time_tiles(f"sweep.{kind}.t{tokens}.m{bm}n{bn}k{bk}w{warps}s{stages}",
                            (x, w13, w2, weights, ids), want, GemmTiles(bm, bn, bk, warps, stages))
            if tokens >= 64 and not w4:  # 4-bit words are N-contiguous: pairing breaks their loads
                _sweep_pairs(x, w13, w2, weights, ids, want, tokens)


# prefill sizes, (gate_up tiles, down tiles): dense experts with gate and up paired in one dot
PREFILL_PAIRS = [((128, 128, 64, 8, 3), (128, 128, 64, 8, 3)), ((128, 128, 64, 8, 4), (128, 128, 64, 8, 3)),
                 ((128, 128, 64, 8, 4), (128, 256, 64, 8, 3)), ((128, 128, 64, 8, 4), (128, 256, 64, 8, 4)),
                 ((128, 128, 64, 8, 3), (128, 256, 64, 8, 4)), ((128, 64, 64, 4, 3), (128, 256, 64, 8, 4))]


def _sweep_pairs(x, w13, w2, weights, ids, want, tokens: int) -> None:
    from homelab_llm.engine.kernels.tuning import GemmTiles, MoeGemmTiles

    for up, down in PREFILL_PAIRS:
        tiles = MoeGemmTiles(GemmTiles(*up), GemmTiles(*down), paired=True)
        key = "m{}n{}k{}w{}s{}".format(*up) + ".down_m{}n{}k{}w{}s{}".format(*down)
        _time_tiles(f"sweep.bf16.t{tokens}.paired.{key}", (x, w13, w2, weights, ids), want, tiles)


def _time_tiles(key: str, args: tuple, want: torch.Tensor, tiles) -> None:
    """One sweep variant: fused_moe(*args, tiles=tiles) timed in a graph, its error to `want`."""
    try:
        got = fused_moe(*args, tiles=tiles)
        ms = bench_graph(lambda: fused_moe(*args, tiles=tiles))
    except Exception as exc:  # a variant that does not fit is reported, not fatal
        print(f"  {key}: {type(exc).__name__}", flush=True)
        return
    report(f"{key}.ms", ms, f"err {rel_err(got, want):.1e}")


# 4-bit prefill GEMMs with the wgmmas kept in flight, both GEMMs, against the table's 128-row
# scaled tiles: (form, block_m, block_n, block_k, warps, stages). pair_accs (four accumulators)
# fits 64-row blocks (sm_90: ~200 registers; 128 spill), joined (one) the table's 128 (~140).
LEFT_PAIR_TILES = [("pair_accs", 64, 128, 64, 8, 3), ("pair_accs", 64, 128, 64, 8, 4),
                   ("pair_accs", 64, 256, 64, 8, 3), ("pair_accs", 64, 128, 128, 8, 3),
                   ("joined", 128, 128, 64, 8, 3), ("joined", 128, 128, 64, 8, 4),
                   ("joined", 64, 128, 64, 8, 3), ("joined", 128, 256, 64, 8, 3)]


def section_sweep_left(setup: Setup, quick: bool, mm_tflops: float) -> None:
    from homelab_llm.engine.kernels.tuning import GemmTiles, MoeGemmTiles

    tokens = 1024 if quick else 2048
    flops = 2 * tokens * TOP_K * 3 * HIDDEN * setup.inter
    x, weights, ids = setup.batch(tokens)
    args = (x, setup.w4, None, weights, ids)
    want = fused_moe(*args)
    report(f"sweep_left.w4a16.t{tokens}.table.ms", bench_graph(lambda: fused_moe(*args)))
    for form, bm, bn, bk, warps, stages in LEFT_PAIR_TILES:
        t = GemmTiles(bm, bn, bk, warps, stages, scaled=True, w_left=True, **{form: True})
        key = f"sweep_left.w4a16.t{tokens}.{form}.m{bm}n{bn}k{bk}w{warps}s{stages}"
        _time_tiles(key, args, want, MoeGemmTiles(t, t))
    report("sweep_left.flop", flops / 1e9, f"GFLOP a layer (matmul {mm_tflops:.0f} TFLOP/s)")


GEMV_SWEEP = [  # (block_n, rows, num_warps)
    (32, 16, 4), (64, 16, 4), (128, 16, 4), (64, 8, 4), (64, 16, 2), (128, 8, 8), (32, 8, 2),
    (128, 16, 8), (256, 16, 8), (256, 8, 8), (32, 16, 1), (64, 16, 1), (128, 16, 2),
]


def section_sweep_gemv(setup: Setup, quick: bool) -> None:
    """The W4A16 decode GEMV under tile variants (auto split, then split 1)."""
    for tokens in (1, 8):
        x, weights, ids = setup.batch(tokens)
        want = w4_decode(x, setup.w4, weights, ids)
        for block_n, rows, warps in GEMV_SWEEP:
            for split in (None, 1, 2, 4):
                kw = dict(block_n=block_n, rows=rows, num_warps=warps, split=split)
                try:
                    got = w4_decode(x, setup.w4, weights, ids, **kw)
                    ms = bench_graph(lambda: w4_decode(x, setup.w4, weights, ids, **kw))
                except Exception as exc:  # a variant that does not fit is reported, not fatal
                    print(f"  sweep_gemv t{tokens} {kw}: {type(exc).__name__}", flush=True)
                    continue
                key = f"sweep_gemv.t{tokens}.n{block_n}r{rows}w{warps}s{split or 'auto'}"
                report(f"{key}.ms", ms, f"err {rel_err(got, want):.1e}")


def section_profile(quick: bool, quantization: str | None = "w4a16") -> None:
    """Whole Qwen3-30B-A3B dummy W4A16 (or bf16: quantization None) at batch 1: graph GPU time vs
    wall time per step (with the host functions that fill the gap), then the eager step's kernels
    by GPU time."""
    import gc

    from engine_gpu import host_vs_graph, make_engine, profile_decode_steps

    prompt = list(range(100, 132))
    label = f"qwen3_30b_a3b_{quantization or 'bf16'}"
    for eager in (False, True):
        engine = make_engine("Qwen3-30B-A3B.json", quantization=quantization, max_model_len=4096,
                             max_num_seqs=8, enforce_eager=eager)
        if eager:
            profile_decode_steps(engine, prompt, label, top=30)
        else:
            host_vs_graph(engine, prompt, label, steps=100, top=25)
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tp", type=int, default=1, help="expert width of one rank at this TP size")
    p.add_argument("--sections", default="check,layer,decode,router,prefill,engine,launches",
                   help="also: engine_bf16 (the 61 GB bf16 model), sweep, sweep_left, sweep_gemv, "
                        "sweep_decode, profile, profile_bf16, prefill_kernels")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    setup = Setup(INTER // a.tp)
    copy_gbps, mm_tflops = peak_copy_gbps(), peak_matmul_tflops()
    report("peak.copy_GBps", copy_gbps)
    report("peak.matmul_TFLOPs", mm_tflops)
    sections = {
        "check": lambda: section_check(setup, a.quick),
        "decode": lambda: section_decode(setup, a.quick, copy_gbps),
        "prefill": lambda: section_prefill(setup, a.quick, mm_tflops),
        "sweep": lambda: section_sweep(setup, a.quick),
        "sweep_left": lambda: section_sweep_left(setup, a.quick, mm_tflops),
        "prefill_kernels": lambda: section_prefill_kernels(setup, a.quick, mm_tflops),
        "sweep_gemv": lambda: section_sweep_gemv(setup, a.quick),
        "router": lambda: section_router(a.quick),
        "engine": lambda: section_engine(a.quick, copy_gbps, "w4a16"),
        "engine_bf16": lambda: section_engine(a.quick, copy_gbps, None),
        "profile": lambda: section_profile(a.quick),
        "profile_bf16": lambda: section_profile(a.quick, None),
        "layer": lambda: section_layer(setup.layers(), copy_gbps),
        "sweep_decode": lambda: section_sweep_decode(setup.layers()),
        "launches": lambda: section_launches(ENGINE_CONFIG),
    }
    return run_sections(sections, a.sections, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
