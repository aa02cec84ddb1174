"""Sliding-window families on one GPU (issue 16): kernels with a window and sinks, Gemma 3 27B decode
at 1K vs 32K context, gpt-oss-20b decode at batch 1 against its active-bytes roofline.

    python3 benchmarks/sliding_gpu.py [--quick] [--sections check,kernel,gemma,gptoss] [--json out]

Sections (each reports even if another fails; dummy weights, no network, < 4 min on an H200):
  check   window + sinks decode and prefill kernels vs the torch reference at full shapes
          (Gemma 3: 32 q / 16 kv heads, d 128, window 1024; gpt-oss: 64 / 8, d 64, window 128,
          sinks), max abs error
  kernel  decode attention of one layer at batch 1, 1K and 32K context, full vs window 1024: a
          sliding layer's time must not grow with the context
  gemma   Gemma-3-27B (assets/model_configs) through LLMEngine, bf16 and W4A16, batch-1 decode
          tok/s after a 1K and a 32K prompt; target: 32K keeps >= 90% of the 1K rate (the 10 global
          layers still read the whole 32K of KV: ~2.7 GB per step, which bounds W4A16's ratio)
  gptoss  gpt-oss-20b shape (24 layers, 32 experts top 4, hidden 2880, window 128, sinks), dummy
          weights with MXFP4 experts (as published) and with bf16 experts, batch-1 decode tok/s
          vs copy bandwidth / active bytes (target >= 50%); experts in the fused MoE kernels
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_harness import report, run_sections  # noqa: E402
from homelab_llm.engine.kernels.decode_attention import paged_decode_attention  # noqa: E402
from homelab_llm.engine.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from homelab_llm.engine.kernels.ref import paged_attention_ref  # noqa: E402

DEV = torch.device("cuda")
ROOT = Path(__file__).resolve().parents[1]
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
    "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
    "num_experts_per_tok": 4, "sliding_window": 128, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
    "rope_theta": 150000.0, "swiglu_limit": 7.0, "torch_dtype": "bfloat16", "eos_token_id": 200002,
}


def bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=3, rep=30, return_mode="median"))


def peak_copy_gbps() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    return 2 * x.numel() / bench(lambda: y.copy_(x)) / 1e6


def paged(seq_lens: list[int], hkv: int, d: int, page: int = 16):
    pages = [(n + page - 1) // page for n in seq_lens]
    total = sum(pages)
    k = torch.randn(total, page, hkv, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    perm = torch.randperm(total, device=DEV).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device=DEV)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used:used + n]
        used += n
    return k, v, table


def section_check() -> None:
    for name, hq, hkv, d, window, sinks in (("gemma3", 32, 16, 128, 1024, False),
                                            ("gpt_oss", 64, 8, 64, 128, True)):
        seq_lens, q_lens = [3000, 700, 90], [1, 300, 90]
        k, v, table = paged(seq_lens, hkv, d)
        s = torch.randn(hq, device=DEV) if sinks else None
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
        qd = torch.randn(3, hq, d, device=DEV, dtype=torch.bfloat16)
        qsl = torch.arange(4, dtype=torch.int32, device=DEV)
        want = paged_attention_ref(qd.float(), k.float(), v.float(), table, qsl, sl, d ** -0.5,
                                   window=window, sinks=s)
        got = paged_decode_attention(qd, k, v, table, qsl, sl, d ** -0.5, window=window, sinks=s)
        report(f"check.{name}.decode_max_abs_err", (got.float() - want).abs().max().item())
        qp = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=torch.bfloat16)
        qsl = torch.tensor([0, 1, 301, 391], dtype=torch.int32, device=DEV)
        want = paged_attention_ref(qp.float(), k.float(), v.float(), table, qsl, sl, d ** -0.5,
                                   window=window, sinks=s)
        got = paged_prefill_attention(qp, k, v, table, qsl, sl, d ** -0.5, window=window, sinks=s)
        report(f"check.{name}.prefill_max_abs_err", (got.float() - want).abs().max().item())


def section_kernel() -> None:
    hq, hkv, d = 32, 16, 128
    for ctx in (1024, 32768):
        k, v, table = paged([ctx], hkv, d)
        q = torch.randn(1, hq, d, device=DEV, dtype=torch.bfloat16)
        qsl = torch.arange(2, dtype=torch.int32, device=DEV)
        sl = torch.tensor([ctx], dtype=torch.int32, device=DEV)
        for window in (0, 1024):
            ms = bench(lambda: paged_decode_attention(q, k, v, table, qsl, sl, 0.088, max_seq_len=ctx,
                                                      window=window))
            report(f"kernel.decode.ctx{ctx}.window{window}_us", ms * 1e3)


def _decode_rate(engine, prompt_len: int, new_tokens: int, tag: str) -> float:
    from homelab_llm.engine.sampling_params import SamplingParams

    rng = random.Random(prompt_len)
    prompt = [rng.randrange(10, 30000) for _ in range(prompt_len)]
    engine.add_request(tag, prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    produced = 0
    while produced == 0:  # the prompt's chunks, up to its first token
        produced = sum(len(o.new_token_ids) for o in engine.step())
    torch.cuda.synchronize()
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    torch.cuda.synchronize()
    return produced / (time.perf_counter() - start)


def _engine(model: str, quantization: str | None, max_len: int):
    from homelab_llm.engine.args import EngineArgs
    from homelab_llm.engine.core import LLMEngine

    return LLMEngine(EngineArgs(model=model, load_format="dummy", device="cuda", dtype="bfloat16",
                                quantization=quantization, max_model_len=max_len, max_num_seqs=4,
                                max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
                                enable_prefix_caching=False))


def section_gemma(quick: bool) -> None:
    config = str(ROOT / "assets" / "model_configs" / "Gemma-3-27B.json")
    new = 32 if quick else 96
    for quant in ("w4a16", None):
        kind = quant or "bf16"
        engine = _engine(config, quant, 33792)
        short = _decode_rate(engine, 1024, new, f"{kind}-1k")
        long = _decode_rate(engine, 32768, new, f"{kind}-32k")
        report(f"gemma.{kind}.b1_ctx1k_tok_s", short)
        report(f"gemma.{kind}.b1_ctx32k_tok_s", long)
        report(f"gemma.{kind}.ctx32k_over_1k_pct", 100 * long / short, "% (target >= 90)")
        del engine


def section_gptoss(quick: bool, copy_gbps: float) -> None:
    """gpt-oss-20b with bf16 experts and with MXFP4 experts (as published, decoded in-kernel)."""
    for kind in ("mxfp4", "bf16"):
        raw = dict(GPT_OSS_20B)
        if kind == "mxfp4":
            raw["quantization_config"] = {"quant_method": "mxfp4"}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "gpt-oss-20b.json"
            path.write_text(json.dumps(raw))
            engine = _engine(str(path), None, 4096)
            cfg = engine.model_config
            weights = engine.status()["devices"][0]["weights"]
            per_weight = 0.5 + 1 / 32 if kind == "mxfp4" else 2
            expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * per_weight
            idle = cfg.num_hidden_layers * (cfg.num_experts - cfg.num_experts_per_tok) * expert
            active = weights - idle - cfg.vocab_size * cfg.hidden_size * 2  # one embedding row read
            roofline = copy_gbps * 1e9 / active
            rate = _decode_rate(engine, 512, 32 if quick else 128, "gptoss")
            report(f"gptoss.{kind}.weights_GB", weights / 1e9)
            report(f"gptoss.{kind}.active_GB", active / 1e9)
            report(f"gptoss.{kind}.b1_roofline_tok_s", roofline)
            report(f"gptoss.{kind}.b1_decode_tok_s", rate)
            report(f"gptoss.{kind}.b1_pct_of_roofline", 100 * rate / roofline, "% (target >= 50)")
            del engine
            torch.cuda.empty_cache()


def section_mx4sweep(quick: bool, copy_gbps: float) -> None:
    """gpt-oss-20b's MXFP4 experts at batch 1 (one layer, 4 picks): the decode GEMV under tile
    variants vs the tl.dot path, GB/s of the picked experts' bytes and % of copy."""
    from homelab_llm.engine.kernels.fused_moe import fused_moe, mx4_decode
    from homelab_llm.engine.kernels.moe_ref import MoeMx4, Mx4Weight

    e, top_k, h, inter = 32, 4, 2880, 2880
    gen = torch.Generator(device=DEV).manual_seed(0)

    def mx4(n, k):
        return Mx4Weight(torch.randint(0, 256, (e, n, k // 2), device=DEV, generator=gen,
                                       dtype=torch.int32).to(torch.uint8),
                         torch.randint(119, 122, (e, n, k // 32), device=DEV, generator=gen,
                                       dtype=torch.int32).to(torch.uint8))

    w = MoeMx4(mx4(2 * inter, h), mx4(h, inter))
    b13 = torch.zeros((e, 2 * inter), dtype=torch.bfloat16, device=DEV)
    b2 = torch.zeros((e, h), dtype=torch.bfloat16, device=DEV)
    x = torch.randn((1, h), dtype=torch.bfloat16, device=DEV)
    ids = torch.randperm(e, device=DEV)[:top_k].view(1, top_k).to(torch.int32)
    weights = torch.full((1, top_k), 1 / top_k, device=DEV)
    picked = top_k * 3 * h * inter * (0.5 + 1 / 32)
    clamp = (1.702, 7.0)
    ms = bench(lambda: fused_moe(x, w, None, weights, ids, b13=b13, b2=b2, clamp=clamp,
                                 decode_gemv=False))
    report("mx4sweep.dot_path_us", ms * 1e3, f"{picked / ms / 1e6:.0f} GB/s")
    for block_n in (8, 16, 32, 64):
        for groups in (2, 4, 8):
            for warps in (1, 2, 4):
                kw = dict(block_n=block_n, groups=groups, num_warps=warps)
                try:
                    ms = bench(lambda: mx4_decode(x, w, weights, ids, b13, b2, clamp, **kw))
                except Exception as exc:  # a variant that does not fit is reported, not fatal
                    print(f"  mx4sweep {kw}: {type(exc).__name__}", flush=True)
                    continue
                gbps = picked / ms / 1e6
                report(f"mx4sweep.n{block_n}g{groups}w{warps}_us", ms * 1e3,
                       f"{gbps:.0f} GB/s, {100 * gbps / copy_gbps:.0f}% of copy")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sections", default="check,kernel,gemma,gptoss")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    copy_gbps = peak_copy_gbps()
    report("peak.copy_GBps", copy_gbps)
    sections = {
        "check": section_check,
        "kernel": section_kernel,
        "gemma": lambda: section_gemma(a.quick),
        "gptoss": lambda: section_gptoss(a.quick, copy_gbps),
        "mx4sweep": lambda: section_mx4sweep(a.quick, copy_gbps),
    }
    return run_sections(sections, a.sections, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
