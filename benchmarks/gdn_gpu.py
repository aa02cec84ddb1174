"""Gated DeltaNet kernels on one GPU at Qwen3.6-27B's linear-attention shape (Hk 16, Hv 48,
Dk = Dv 128, conv over 10240 channels, width 4): correctness of every kernel against its torch
reference (kernels/gdn_ref.py) and speed side by side with fla-core, with the bandwidth each implies.

    python3 benchmarks/gdn_gpu.py [--quick] [--json out.json] [--sections check,prefill,decode,verify,misc]

Sections:
  check    every kernel vs its reference at full shapes (max abs error and rel = err / max|ref|),
           fla-core's outputs vs the same references (proves both compute the same thing)
  prefill  chunked rule, T tokens per sequence x B sequences (T 2048/8192, B 1/8): ours vs fla
           chunk_gated_delta_rule (both with q/k L2 norm in the kernel, initial and final state).
           Ours in its variants: `table` (what the engine runs), `fused` (outputs inside the
           sequential walk, gdn_chunk.py), `split` (state walk + parallel output kernel,
           gdn_chunk_split.py), split with 16- and 64-row solves (solve_rows: gfx1100 takes 64)
           and, without --quick, split with one other GdnTiles field changed (state_warps,
           block_v, out_block_v, chunk_stages): the row to pick the table from.
  decode   one token for B sequences (1/8/32) from a 64-slot state pool: ours (in place, slot
           indices) vs fla fused_recurrent_gated_delta_rule (gathered initial states, final state out)
  verify   the engine's decode-step call (gating and gated norm in the kernel) for G sequences x R
           rows (G 1/4/8, R 1/2/3/5) with pending rows (kernels/gdn_pending.py): R > 1 a verify
           group replaying 2 rows of the previous one; R = 1 a decode after a verify (2 rows
           replayed) beside the plain decode (nothing pending, with and without the areas: a
           speculating engine's rows without drafts run the former); timed as a CUDA graph of 20 calls,
           and the conv decode the same way
  misc     conv1d prefill/decode, gated RMSNorm, gating
GB/s counts the bytes each kernel must move at least (inputs once, outputs once, states read and
written once); the copy ceiling is a device-to-device copy measured in the same run. fla-core is
optional: without it (pip install fla-core einops) its columns print as '-'.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_harness import report, run_sections  # noqa: E402

from homelab_llm.engine.kernels import gdn, gdn_chunk, gdn_ref, tuning  # noqa: E402

HK, HV, D, CONV_C, WIDTH, SLOTS = 16, 48, 128, 2 * 16 * 128 + 48 * 128, 4, 64
DT = torch.bfloat16
ARGS = argparse.Namespace(quick=False)


def bench(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=60, return_mode="median"))


def fla_ops():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 - any import failure means: no peer column
        print(f"fla-core not importable ({type(exc).__name__}: {exc}); its columns are skipped", flush=True)
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def copy_gbps() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / bench(lambda: y.copy_(x)) / 1e6


def rule_inputs(seqs: int, tokens: int, gen: torch.Generator) -> dict:
    """Model-like inputs: decays from the gating formula, betas in (0, 1), a random state pool."""
    t = seqs * tokens
    dev = "cuda"
    a, b = torch.randn(t, HV, generator=gen).to(dev), torch.randn(t, HV, generator=gen).to(dev, DT)
    g, beta = gdn_ref.gdn_gating_ref(a, b, torch.empty(HV).uniform_(-4.6, 2.7, generator=gen).to(dev),
                                     torch.zeros(HV, device=dev))
    return dict(q=torch.randn(t, HK, D, generator=gen).to(dev, DT), k=torch.randn(t, HK, D, generator=gen).to(dev, DT),
                v=torch.randn(t, HV, D, generator=gen).to(dev, DT), g=g, beta=beta,
                cu=torch.arange(0, t + 1, tokens, dtype=torch.int32, device=dev),
                state=torch.randn(SLOTS, HV, D, D, generator=gen).to(dev) * 0.1,
                slots=torch.randperm(SLOTS, generator=gen)[:seqs].to(dev, torch.int32),
                init=torch.ones(seqs, dtype=torch.bool, device=dev))


def errs(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    err = (got.float() - want.float()).abs().max().item()
    return err, err / max(want.float().abs().max().item(), 1e-6)


def fla_prefill(fla, x: dict, state: torch.Tensor):
    chunk, _ = fla
    seqs = x["slots"].shape[0]
    return chunk(x["q"][None], x["k"][None], x["v"][None], x["g"][None], x["beta"][None], initial_state=state,
                 output_final_state=True, use_qk_l2norm_in_kernel=True,
                 cu_seqlens=x["cu"].long() if seqs > 1 else None)


def fla_decode(fla, x: dict, state: torch.Tensor):
    _, recurrent = fla
    return recurrent(x["q"][:, None], x["k"][:, None], x["v"][:, None], x["g"][:, None], x["beta"][:, None],
                     initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)


def rule_bytes(tokens: int, seqs: int) -> int:
    io = tokens * (2 * HK * D * 2 + HV * D * 2 * 2 + HV * (4 + 2))  # q, k, v, o, g, beta
    return io + seqs * HV * D * D * 4 * 2  # states read and written


def section_check() -> None:
    gen = torch.Generator().manual_seed(0)
    fla = fla_ops()
    x = rule_inputs(4, 2048 if not ARGS.quick else 700, gen)
    x["cu"] = torch.tensor([0, 1, 63, 1100, x["q"].shape[0]], dtype=torch.int32, device="cuda")  # mixed lengths
    x["init"] = torch.tensor([True, False, True, True], device="cuda")
    s_ref, s_ker = x["state"].clone(), x["state"].clone()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"])
    want = gdn_ref.gated_delta_rule_prefill_ref(*args, s_ref, x["slots"], x["init"])
    got = gdn.gated_delta_rule_prefill(*args, s_ker, x["slots"], x["init"])
    for name, (e, r) in (("out", errs(got, want)), ("state", errs(s_ker, s_ref))):
        report(f"check prefill {name} max_err", e)
        report(f"check prefill {name} rel_err", r)
    for split in (False, True):  # both second halves, whichever the table picks
        s_var = x["state"].clone()
        got = gdn_chunk.chunk_gated_delta_rule(*args, s_var, x["slots"], x["init"], split=split)
        report(f"check prefill {'split' if split else 'fused'} out rel_err", errs(got, want)[1])
        report(f"check prefill {'split' if split else 'fused'} state rel_err", errs(s_var, s_ref)[1])
    if fla is not None:
        init = x["state"][x["slots"].long()] * x["init"][:, None, None, None]
        o, s = fla_prefill(fla, x, init)
        report("check fla prefill out rel_err", errs(o[0], want)[1])
        report("check fla prefill state rel_err", errs(s, s_ref[x["slots"].long()])[1])

    xd = rule_inputs(32, 1, gen)
    xd["slots"][5] = -1
    s_ref, s_ker = xd["state"].clone(), xd["state"].clone()
    dargs = (xd["q"], xd["k"], xd["v"], xd["g"], xd["beta"])
    want = gdn_ref.gated_delta_rule_decode_ref(*dargs, s_ref, xd["slots"])
    got = gdn.gated_delta_rule_decode(*dargs, s_ker, xd["slots"])
    report("check decode out rel_err", errs(got, want)[1])
    report("check decode state rel_err", errs(s_ker, s_ref)[1])
    if fla is not None:
        live = (xd["slots"] >= 0).nonzero().flatten()
        o, s = fla_decode(fla, {k: t[live] for k, t in xd.items() if k in "q k v g beta".split()},
                          xd["state"][xd["slots"][live].long()])
        report("check fla decode out rel_err", errs(o[:, 0], want[live])[1])
        report("check fla decode state rel_err", errs(s, s_ref[xd["slots"][live].long()])[1])

    conv_x = torch.randn(8192, CONV_C, generator=gen).to("cuda", DT)
    weight = torch.randn(CONV_C, WIDTH, generator=gen).to("cuda", DT)
    cu = torch.tensor([0, 1, 2, 3000, 8192], dtype=torch.int32, device="cuda")
    cs = torch.randn(SLOTS, WIDTH - 1, CONV_C, generator=gen).to("cuda", DT)
    slots, init = torch.tensor([7, 3, -1, 0], dtype=torch.int32, device="cuda"), x["init"]
    c_ref, c_ker = cs.clone(), cs.clone()
    want = gdn_ref.causal_conv1d_prefill_ref(conv_x, weight, None, cu, c_ref, slots, init)
    got = gdn.causal_conv1d_prefill(conv_x, weight, None, cu, c_ker, slots, init)
    report("check conv prefill rel_err", errs(got, want)[1])
    report("check conv prefill state exact", float(torch.equal(c_ref, c_ker)))
    want = gdn_ref.causal_conv1d_decode_ref(conv_x[:4], weight, None, c_ref, slots)
    got = gdn.causal_conv1d_decode(conv_x[:4], weight, None, c_ker, slots)
    report("check conv decode rel_err", errs(got, want)[1])
    report("check conv decode state exact", float(torch.equal(c_ref, c_ker)))

    z, o = (torch.randn(8192 * HV, D, generator=gen).to("cuda", DT) for _ in range(2))
    w = torch.randn(D, generator=gen).to("cuda", DT)
    report("check gated_rms_norm rel_err",
           errs(gdn.gated_rms_norm(o, z, w, 1e-6), gdn_ref.gated_rms_norm_ref(o, z, w, 1e-6))[1])
    a = torch.randn(8192, HV, generator=gen).to("cuda", DT) * 4
    a_log, dt_bias = torch.randn(HV, generator=gen).cuda(), torch.randn(HV, generator=gen).cuda()
    for name, got, want in zip(("g", "beta"), gdn.gdn_gating(a, a, a_log, dt_bias),
                               gdn_ref.gdn_gating_ref(a, a, a_log, dt_bias)):
        report(f"check gating {name} rel_err", errs(got, want)[1])


def _row(label: str, ms: float, nbytes: int, fla_ms: float | None, ceiling: float) -> None:
    gbps = nbytes / ms / 1e6
    fla_txt = f"{fla_ms:8.3f} ms ({nbytes / fla_ms / 1e6:7.0f} GB/s)  ours/fla speed {fla_ms / ms:5.2f}x" \
        if fla_ms else "       -"
    print(f"  {label:42s} ours {ms:8.3f} ms ({gbps:7.0f} GB/s, {100 * gbps / ceiling:4.1f}% of copy)   "
          f"fla {fla_txt}", flush=True)
    report(f"{label} ours_ms", ms, "ms")
    if fla_ms:
        report(f"{label} fla_ms", fla_ms, "ms")


def prefill_variants() -> list[tuple[str, dict]]:
    """(label, GdnTiles fields to change) per timed variant of our prefill."""
    # solve_rows 64: gfx1100's spill-free triangular solve (forward substitution, no dots), timed
    # beside the 16-row blocks on any GPU for its cost
    variants = [("fused", dict(split=False)), ("split", dict(split=True)),
                ("split solve_rows=16", dict(split=True, solve_rows=16)),
                ("split solve_rows=64", dict(split=True, solve_rows=64))]
    if not ARGS.quick:
        variants += [("split state_warps=8", dict(split=True, state_warps=8)),
                     ("split block_v=64", dict(split=True, block_v=64)),
                     ("split block_v=16", dict(split=True, block_v=16)),
                     ("split out_block_v=128", dict(split=True, out_block_v=128)),
                     ("split chunk_stages=1", dict(split=True, chunk_stages=1)),
                     ("split chunk_stages=3", dict(split=True, chunk_stages=3))]
    return variants


class table_override:
    """The GDN tuning-table entry of this GPU with some fields changed, inside a with block."""

    def __init__(self, fields: dict) -> None:
        self.arch, self.fields = tuning.arch_name(torch.device("cuda")), fields

    def __enter__(self) -> None:
        self.saved = tuning.GDN_TABLE[self.arch]
        tuning.GDN_TABLE[self.arch] = dataclasses.replace(self.saved, **self.fields)

    def __exit__(self, *exc) -> None:
        tuning.GDN_TABLE[self.arch] = self.saved


def section_prefill() -> None:
    fla, ceiling = fla_ops(), copy_gbps()
    report("copy ceiling", ceiling, "GB/s")
    gen = torch.Generator().manual_seed(1)
    cases = [(1, 2048), (8, 2048)] if ARGS.quick else [(1, 2048), (1, 8192), (8, 2048), (8, 8192)]
    for seqs, tokens in cases:
        prefill_case(fla, ceiling, seqs, tokens, rule_inputs(seqs, tokens, gen))
        torch.cuda.empty_cache()  # the case's tensors are gone with its frame


def prefill_case(fla, ceiling: float, seqs: int, tokens: int, x: dict) -> None:
    """One (sequences, tokens) row set of section_prefill: the table, fla-core, our variants."""
    state = x["state"].clone()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"], state, x["slots"], x["init"])
    fla_ms = None
    if fla is not None:
        init = x["state"][x["slots"].long()]
        fla_ms = bench(lambda: fla_prefill(fla, x, init))
    ms = bench(lambda: gdn.gated_delta_rule_prefill(*args))
    _row(f"prefill B={seqs} T={tokens} table", ms, rule_bytes(seqs * tokens, seqs), fla_ms, ceiling)
    for label, over in prefill_variants():
        with table_override(over):
            ms = bench(lambda: gdn_chunk.chunk_gated_delta_rule(*args))
        _row(f"prefill B={seqs} T={tokens} {label}", ms, rule_bytes(seqs * tokens, seqs), fla_ms, ceiling)


def section_decode() -> None:
    fla, ceiling = fla_ops(), copy_gbps()
    gen = torch.Generator().manual_seed(2)
    for seqs in (1, 8, 32):
        x = rule_inputs(seqs, 1, gen)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], x["slots"])
        ms = bench(lambda: gdn.gated_delta_rule_decode(*args))
        fla_ms = None
        if fla is not None:
            init = x["state"][x["slots"].long()].contiguous()
            fla_ms = bench(lambda: fla_decode(fla, x, init))
        _row(f"decode B={seqs}", ms, rule_bytes(seqs, seqs), fla_ms, ceiling)


def graph_us(fn: Callable[[], object], calls: int = 20) -> float:
    """us a call of fn, from replays of a CUDA graph of `calls` calls (no launch gaps)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return 1000 * bench(graph.replay) / calls


def section_verify() -> None:
    from homelab_llm.engine.kernels.gdn_pending import PendingRows, state_word

    ceiling = copy_gbps()
    gen = torch.Generator().manual_seed(4)
    pend = PendingRows.allocate(SLOTS, 5, HK, D, HV, D, CONV_C, DT, torch.device("cuda"))
    pend.d.uniform_(0.1, 1.0)
    pend.k.normal_().div_(D ** 0.5)
    pend.u.normal_()
    pend.x.normal_()
    a_log, dt_bias = torch.zeros(HV, device="cuda"), torch.zeros(HV, device="cuda")
    norm_w = torch.ones(D, device="cuda", dtype=DT)
    weight = torch.randn(CONV_C, WIDTH, generator=gen).to("cuda", DT)
    conv_state = torch.randn(SLOTS, WIDTH - 1, CONV_C, generator=gen).to("cuda", DT)
    term = (HV * D + HK * D + HV) * 4
    for groups in (1, 4, 8):
        # (1, 0, True): a plain decode on the pending-row kernel (what a speculating engine's
        # rows without drafts run) against (1, 0, False), the kernel without the areas
        for rows, count, pending in ((1, 0, False), (1, 0, True), (1, 2, True), (2, 2, True), (3, 2, True),
                                     (5, 2, True)):
            x = rule_inputs(groups * rows, 1, gen)
            words = torch.tensor([state_word(g, count) if j == 0 else g for g in range(groups) for j in range(rows)],
                                 dtype=torch.int32, device="cuda")
            areas = pend if pending else None
            z = torch.randn(groups * rows, HV, D, generator=gen).to("cuda", DT)
            ba = torch.randn(groups * rows, 2 * HV, generator=gen).to("cuda", DT)

            def rule():
                return gdn.gated_delta_rule_decode(x["q"], x["k"], x["v"], ba[:, HV:], ba[:, :HV], x["state"], words,
                                                   rows_per_seq=rows, gating=(a_log, dt_bias),
                                                   gated_norm=(z, norm_w, 1e-6), pending=areas)

            xc = torch.randn(groups * rows, CONV_C, generator=gen).to("cuda", DT)
            us, conv_us = graph_us(rule), graph_us(
                lambda: gdn.causal_conv1d_decode(xc, weight, None, conv_state, words, rows, areas))
            nbytes = rule_bytes(groups * rows, groups) + groups * (count + (rows if rows > 1 else 0)) * term
            label = f"verify G={groups} R={rows} pending={count}" if areas is not None else f"plain G={groups}"
            print(f"  {label:34s} rule {us:7.2f} us ({nbytes / us / 1e3:6.0f} GB/s, "
                  f"{100 * nbytes / us / 1e3 / ceiling:4.1f}% of copy)   conv {conv_us:6.2f} us", flush=True)
            report(f"{label} rule_us", us, "us")
            report(f"{label} conv_us", conv_us, "us")


def section_misc() -> None:
    ceiling = copy_gbps()
    gen = torch.Generator().manual_seed(3)
    tokens = 8192
    x = torch.randn(tokens, CONV_C, generator=gen).to("cuda", DT)
    weight = torch.randn(CONV_C, WIDTH, generator=gen).to("cuda", DT)
    cs = torch.zeros(SLOTS, WIDTH - 1, CONV_C, device="cuda", dtype=DT)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    one, init = torch.tensor([3], dtype=torch.int32, device="cuda"), torch.tensor([True], device="cuda")
    ms = bench(lambda: gdn.causal_conv1d_prefill(x, weight, None, cu, cs, one, init))
    _row(f"conv prefill T={tokens}", ms, 2 * x.numel() * 2, None, ceiling)
    for seqs in (1, 32):
        slots = torch.arange(seqs, dtype=torch.int32, device="cuda")
        ms = bench(lambda: gdn.causal_conv1d_decode(x[:seqs], weight, None, cs, slots))
        _row(f"conv decode B={seqs}", ms, seqs * CONV_C * 2 * (2 + 2 * (WIDTH - 1)), None, ceiling)
    o, z = (torch.randn(tokens * HV, D, generator=gen).to("cuda", DT) for _ in range(2))
    w = torch.ones(D, device="cuda", dtype=DT)
    ms = bench(lambda: gdn.gated_rms_norm(o, z, w, 1e-6))
    _row(f"gated_rms_norm T={tokens}", ms, 3 * o.numel() * 2, None, ceiling)
    a = torch.randn(tokens, HV, generator=gen).to("cuda", DT)
    zeros = torch.zeros(HV, device="cuda")
    ms = bench(lambda: gdn.gdn_gating(a, a, zeros, zeros))
    _row(f"gating T={tokens}", ms, tokens * HV * (2 + 2 + 4 + 2), None, ceiling)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--sections", default="check,prefill,decode,verify,misc")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA/HIP GPU")
        return 1
    ARGS.quick = a.quick
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    sections = {"check": section_check, "prefill": section_prefill, "decode": section_decode,
                "verify": section_verify, "misc": section_misc}
    return run_sections(sections, a.sections, a.json)


if __name__ == "__main__":
    sys.exit(main())
