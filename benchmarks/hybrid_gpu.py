"""The Qwen3.6-27B-class hybrid (Gated DeltaNet + attention) on one GPU, next to its ceilings.

    python benchmarks/hybrid_gpu.py [--quick] [--sections ceilings,decode,replay] [--json OUT]

Sections:
  ceilings  device copy bandwidth (bytes read + written), measured here (engine_gpu's section)
  decode    Qwen3.6-27B shape, W4A16 dummy weights, int8 KV: batch-1 and batch-8 decode; batch 1
            against the weight-read roofline (weight bytes / copy bandwidth), batch 8 / batch 1
  bf16      the same shape in bf16 at batch 1 (the unquantized roofline fraction)
  profile   GPU time per kernel name over eager batch-1 decode steps (graphs off, so every
            launch shows), for --model (default the hybrid; any assets/model_configs JSON)
  replay    a 16-turn agent session: each turn's prompt is the previous prompt + the previous
            answer + new user tokens. TTFT of every turn with prefix caching on, next to the time
            to prefill only the turn's new tokens (a fresh prompt of that length, same engine);
            the ratio should stay <= 1.2 (no re-prefill of earlier turns). Also reports
            cached_tokens per turn.
Needs only torch and triton (dummy weights, no server packages).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from engine_gpu import (ceilings, cleanup, decode_rate, make_engine,  # noqa: E402
                        prefill_seconds, profile_decode_steps, random_prompt)
from gpu_harness import report, results, run_sections  # noqa: E402

from homelab_llm.engine.sampling_params import SamplingParams  # noqa: E402

MODEL = "Qwen3.6-27B.json"


def roofline(engine, key: str) -> None:
    weights = engine.status()["devices"][0]["weights"]
    report(f"{key}_weight_bytes_GB", weights / 1e9, "GB")
    if "copy_bandwidth_GBps" in results:
        report(f"{key}_b1_roofline_tok_s", results["copy_bandwidth_GBps"] * 1e9 / weights, "tok/s")


def section_decode(quick: bool) -> None:
    engine = make_engine(MODEL, max_model_len=8192, quantization="w4a16", kv_cache_dtype="int8",
                         max_num_seqs=8)
    roofline(engine, "q36_27b_w4a16")
    decode_rate(engine, 1, 32, 16)  # warm-up: graphs, autotune
    b1 = decode_rate(engine, 1, 512, 64 if quick else 128)
    report("q36_27b_w4a16_b1_decode_tok_s", b1, "tok/s")
    if "q36_27b_w4a16_b1_roofline_tok_s" in results:
        report("q36_27b_w4a16_b1_roofline_frac", b1 / results["q36_27b_w4a16_b1_roofline_tok_s"])
    b8 = decode_rate(engine, 8, 512, 64 if quick else 128)
    report("q36_27b_w4a16_b8_decode_tok_s", b8, "tok/s")
    report("q36_27b_w4a16_b8_over_b1", b8 / b1, "x")
    report("q36_27b_w4a16_state_bytes_GB", engine.status()["devices"][0].get("state", 0) / 1e9, "GB")
    del engine
    cleanup()


def section_bf16(quick: bool) -> None:
    engine = make_engine(MODEL, max_model_len=4096, max_num_seqs=4)
    roofline(engine, "q36_27b_bf16")
    decode_rate(engine, 1, 32, 16)
    b1 = decode_rate(engine, 1, 512, 64 if quick else 128)
    report("q36_27b_bf16_b1_decode_tok_s", b1, "tok/s")
    if "q36_27b_bf16_b1_roofline_tok_s" in results:
        report("q36_27b_bf16_b1_roofline_frac", b1 / results["q36_27b_bf16_b1_roofline_tok_s"])
    del engine
    cleanup()


def section_profile(model: str) -> None:
    engine = make_engine(model, max_model_len=4096, quantization="w4a16", kv_cache_dtype="int8",
                         enforce_eager=True, max_num_seqs=8)
    whole = profile_decode_steps(engine, list(range(100, 612)), model, top=30)
    report(f"{model}_eager_step_gpu_kernel_us", whole, "us")
    del engine
    cleanup()


def ttft(engine, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(seconds to the first token, the generated tokens, cached prompt tokens) of one request."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=True))
    torch.cuda.synchronize()
    start, first, tokens, cached = time.perf_counter(), None, [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            cached = max(cached, out.num_cached_tokens)
            if first is None and tokens:
                first = time.perf_counter() - start
    return first or 0.0, tokens, cached


def section_replay(quick: bool) -> None:
    engine = make_engine(MODEL, max_model_len=65536, quantization="w4a16", kv_cache_dtype="int8",
                         max_num_seqs=8, enable_prefix_caching=True)
    rng = random.Random(16)
    vocab = engine.model_config.vocab_size
    turns = 6 if quick else 16
    prompt = random_prompt(2048, vocab, rng)  # the system prompt + tools of an agent
    ttft(engine, "warm", random_prompt(256, vocab, rng), 4)
    worst = 0.0
    for turn in range(turns):
        new = random_prompt(rng.randrange(200, 1500), vocab, rng)
        prompt = prompt + new
        seconds, answer, cached = ttft(engine, f"turn{turn}", prompt, 64)
        fresh = prefill_seconds(engine, len(new)) if turn else seconds
        ratio = seconds / max(fresh, 1e-6)
        worst = max(worst, ratio if turn else 0.0)
        print(f"turn {turn:2d}: prompt {len(prompt):6d}  new {len(new):5d}  cached {cached:6d}  "
              f"ttft {seconds * 1e3:7.1f} ms  new-only prefill {fresh * 1e3:7.1f} ms  "
              f"ratio {ratio:5.2f}", flush=True)
        prompt = prompt + answer
    report("q36_27b_replay_worst_ttft_over_new_prefill", worst, "x")
    del engine
    cleanup()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sections", default="ceilings,decode,bf16,replay")
    p.add_argument("--json")
    p.add_argument("--model", default=MODEL, help="the profile section's model_configs JSON")
    a = p.parse_args()
    sections = {"ceilings": ceilings, "decode": lambda: section_decode(a.quick),
                "bf16": lambda: section_bf16(a.quick),
                "profile": lambda: section_profile(a.model), "replay": lambda: section_replay(a.quick)}
    return run_sections(sections, a.sections, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
