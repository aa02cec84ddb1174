"""MTP speculative decoding with captured graphs vs eager: same tokens, same drafts, step times.

    python benchmarks/mtp_graphs_check.py [--quick] [--json OUT.json]
    python benchmarks/mtp_graphs_check.py --cpu-smoke   # tiny model only, CPU, graphs replayed
                                                        # eagerly (graph_capture.EagerCapture)
Also `python benchmarks/spec_gpu.py --sections mtp_graphs`.

Two models, K = 3, each built once with its graphs (decode/verify graphs that keep the final
hidden rows, and the MTP head's own graphs, spec/mtp_graphs.py) and run with the graphs set aside
(the runner's eager path, as --enforce-eager) and then with them; no prefix cache:
  tiny   a tiny random Qwen3.5-shaped hybrid (4 layers, fp32, dummy weights) with an MTP layer
  27b    the dummy Qwen3.6-27B W4A16 shape with its MTP layer (bf16)
Both heads are turned into "echo" heads after loading (as tests/engine/mtp_reference.py does: fc
passes the target's hidden state through, the layer adds nothing, plain norms), so each draft
repeats the token the target just chose, and the target's lm_head leans toward repeating its
input token (lm_head += 0.2 x embedding): drafts get accepted wherever the target repeats.

Check: greedy generation of 4 prompts (batched) in both modes: `same_tokens` (1 = identical
output), `same_drafts` (fraction of the stored drafts, in order, that are identical; 1 = all),
acceptance rate. fp32 tiny: expect 1 / 1. bf16 27B: the graphs' fixed KV-split counts round
differently from eager decode attention, so a near-tie may flip a token late in a sequence (then
drafts after it differ too): expect 1 or a late first divergence (`first_diff` token index).
Timing (27B, 512-token contexts, batch 1 and 8, K = 0..3 drafts taken, verify width fixed at 4):
median engine step (verify + the head's pass and chain) and the MTP drafting alone, graphs vs
eager, printed as one table. Needs torch + triton (transformers not used).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from itertools import chain
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from homelab_llm.assets import assets_dir  # noqa: E402
from homelab_llm.engine.args import EngineArgs  # noqa: E402
from homelab_llm.engine.core import LLMEngine  # noqa: E402
from homelab_llm.engine.graph_capture import EagerCapture  # noqa: E402
from homelab_llm.engine.sampling_params import SamplingParams  # noqa: E402
from homelab_llm.engine.spec.stats import SpecDecodeStats  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_harness import report, run_sections  # noqa: E402

CONFIG = assets_dir() / "model_configs" / "Qwen3.6-27B.json"
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 512, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "num_hidden_layers": 4}
K = 3
QUICK = False
CPU = False


def tiny_config(folder: Path) -> Path:
    config = json.loads(CONFIG.read_text())
    text = config.get("text_config", config)
    text.update({key: value for key, value in TINY.items() if key in text})
    text["layer_types"] = text["layer_types"][:4]
    out = folder / "tiny.json"
    out.write_text(json.dumps(config))
    return out


@torch.no_grad()
def echo_head(model) -> None:
    """fc = [0 | I] (the hidden half passes), o_proj and down_proj output 0 (4-bit: scales and
    biases zeroed), every norm plain: h' = rms-normalized h, so the draft is the target's token."""
    mtp = model.mtp
    h = mtp.fc.weight.shape[0]
    mtp.fc.weight.zero_()
    mtp.fc.weight[:, h:] = torch.eye(h, dtype=mtp.fc.weight.dtype, device=mtp.fc.weight.device)
    for name, module in mtp.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("o_proj", "down_proj") or "norm" in leaf:
            for t in chain(module.parameters(recurse=False), module.buffers(recurse=False)):
                if t is not None and t.is_floating_point():
                    t.fill_(1.0 if "norm" in leaf else 0.0)  # loaded norms hold 1 + w (norm.py)


@torch.no_grad()
def lean_to_repeats(model, alpha: float = 0.2) -> None:
    """lm_head += alpha * embedding: a dummy target then often repeats its last token (which an
    echo head drafts), while still choosing other tokens elsewhere: drafts get accepted and
    rejected."""
    w, e = model.lm_head.weight, model.model.embed_tokens.weight
    n = min(w.shape[0], e.shape[0])
    w[:n] += alpha * e[:n].to(w.dtype)


def build(model: Path, quantization: str | None) -> LLMEngine:
    """An MTP engine with its graphs captured (CPU: EagerCapture stand-ins), echo head, no
    prefix cache (both modes must compute every position)."""
    engine = LLMEngine(EngineArgs(
        model=str(model), load_format="dummy", device="cpu" if CPU else "cuda",
        dtype="float32" if quantization is None else "bfloat16", quantization=quantization,
        max_num_seqs=8, max_model_len=2048, kv_cache_memory_bytes=(64 << 20) if CPU else (4 << 30),
        enforce_eager=CPU, page_size=16, enable_prefix_caching=False,
        speculative_config=json.dumps({"method": "mtp", "num_speculative_tokens": K})))
    if CPU:
        engine.runner.install_graphs(engine.max_model_len, EagerCapture())
    echo_head(engine.runner.model)
    lean_to_repeats(engine.runner.model)
    return engine


def set_mode(engine: LLMEngine, captured: tuple, graphs: bool) -> None:
    """Graphs on (the captured ones back) or off (the runner's eager path, as --enforce-eager)."""
    runner = engine.runner
    runner.graphs, runner.head_graphs = captured if graphs else (None, None)
    engine.spec_stats = SpecDecodeStats(K)


def sync() -> None:
    if not CPU:
        torch.cuda.synchronize()


def generate(engine: LLMEngine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy outputs of `prompts` (batched) and every draft stored, in order."""
    drafts: list[list[int]] = []
    proposer = engine.drafter.proposer
    store = proposer.store
    proposer.store = lambda rid, num, tokens: (drafts.append(list(tokens)), store(rid, num, tokens))
    tag = time.monotonic_ns()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        engine.add_request(f"g{tag}-{i}", prompt, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    proposer.store = store
    return [outputs[f"g{tag}-{i}"] for i in range(len(prompts))], drafts


def step_times(engine: LLMEngine, batch: int, ctx: int, steps: int) -> tuple[float, float]:
    """Median ms of engine.step() and of the MTP drafting inside it, `batch` requests decoding."""
    drafter = engine.mtp
    run_draft, draft_times = drafter.draft, []

    def timed(work, num_running: int) -> None:
        sync()
        t = time.perf_counter()
        run_draft(work, num_running)
        sync()
        draft_times.append(time.perf_counter() - t)

    drafter.draft = timed
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    tag = time.monotonic_ns()
    for i in range(batch):
        engine.add_request(f"t{tag}-{i}", [rng.randrange(10, vocab - 10) for _ in range(ctx)],
                           SamplingParams(max_tokens=steps * 8 + 8, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    sync()
    times = []
    draft_times.clear()
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - t)
    for i in range(batch):
        engine.abort_request(f"t{tag}-{i}")
    engine.step()
    drafter.draft = run_draft
    median = lambda xs: 1000 * sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
    return median(times), median(draft_times)


def run_model(tag: str, model: Path, quantization: str | None, timed: bool) -> None:
    rng = random.Random(7)
    vocab = json.loads(model.read_text()).get("vocab_size") or 512
    span = [rng.randrange(10, min(vocab, 20000)) for _ in range(24)]
    prompts = [span + span[:12], span[5:] + span, span[:9] * 3, span[::-1]]
    n = 24 if QUICK else 48
    results, timings = {}, {}
    engine = build(model, quantization)
    captured = engine.runner.graphs, engine.runner.head_graphs
    try:
        for graphs in (False, True):
            set_mode(engine, captured, graphs)
            results[graphs] = generate(engine, prompts, n)
            report(f"mtp_graphs_{tag}_{'graph' if graphs else 'eager'}_acceptance",
                   engine.status()["spec_decode"]["acceptance_rate"], "(echo head)")
            if timed:
                for batch in (1, 8):
                    for k in range(K + 1):
                        engine.drafter.proposer.k = k
                        timings[graphs, batch, k] = step_times(engine, batch, 64 if CPU else 512,
                                                               6 if QUICK else 16)
                    engine.drafter.proposer.k = K
    finally:
        set_mode(engine, captured, True)  # shutdown releases them
        engine.shutdown()
    (eager_out, eager_drafts), (graph_out, graph_drafts) = results[False], results[True]
    report(f"mtp_graphs_{tag}_same_tokens", float(eager_out == graph_out), "(1 = identical)")
    diffs = [j for a, b in zip(eager_out, graph_out) for j, (x, y) in enumerate(zip(a, b)) if x != y]
    report(f"mtp_graphs_{tag}_first_diff", float(min(diffs, default=-1)), "token index (-1: none)")
    same = sum(a == b for a, b in zip(eager_drafts, graph_drafts))
    report(f"mtp_graphs_{tag}_same_drafts", same / max(1, len(eager_drafts), len(graph_drafts)),
           f"of {len(eager_drafts)} stored drafts")
    if timings:
        print(f"\n{tag}: step ms (verify + MTP pass/chain) | MTP drafting ms, median")
        print(f"{'batch':>5} {'K':>2} {'eager step':>11} {'graph step':>11} {'x':>6} "
              f"{'eager draft':>12} {'graph draft':>12}")
        for batch in (1, 8):
            for k in range(K + 1):
                (es, ed), (gs, gd) = timings[False, batch, k], timings[True, batch, k]
                print(f"{batch:>5} {k:>2} {es:>11.2f} {gs:>11.2f} {es / gs:>6.2f} {ed:>12.2f} {gd:>12.2f}")
                report(f"mtp_graphs_{tag}_b{batch}_K{k}_eager_step_ms", es, "ms")
                report(f"mtp_graphs_{tag}_b{batch}_K{k}_graph_step_ms", gs, f"ms ({es / gs:.2f}x faster)")
                report(f"mtp_graphs_{tag}_b{batch}_K{k}_graph_draft_ms", gd, f"ms (eager {ed:.2f})")
        print()


def mtp_graphs() -> None:
    """The 27B shape first (the numbers that matter), then the tiny model; either may fail alone."""
    runs = [("27b", lambda folder: CONFIG, "w4a16", True)] if not CPU else []
    runs.append(("tiny", tiny_config, None, CPU))
    for tag, config, quantization, timed in runs:
        try:
            with tempfile.TemporaryDirectory() as folder:
                run_model(tag, config(Path(folder)), quantization, timed)
        except Exception:  # keep the other model's numbers
            traceback.print_exc()
            print(f"mtp_graphs {tag} failed", flush=True)


def main() -> int:
    global QUICK, CPU
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    QUICK, CPU = args.quick, args.cpu_smoke
    return run_sections({"mtp_graphs": mtp_graphs}, "mtp_graphs", args.json)


if __name__ == "__main__":
    sys.exit(main())
