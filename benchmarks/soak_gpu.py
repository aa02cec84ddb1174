"""Soak the engine with a bounded random mix and check it ends clean.

    python3 benchmarks/soak_gpu.py [--small | --large] [--minutes M] [--kv int8,bf16]
                                   [--async on,off] [--seed S] [--json OUT.json]
    compute-sanitizer --tool memcheck python3 benchmarks/soak_gpu.py --small --minutes 1
    python3 benchmarks/soak_gpu.py --device cpu --quick        # the same loop, tiny, on the CPU
    python3 benchmarks/soak_gpu.py --large --kv int8 --async on --max-model-len 131072 \
        --hf-overrides '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 32768}}'   # issue 12's crash, fixed

In process, through the engine API (so compute-sanitizer sees every kernel). For each model
(--large: the Qwen3-8B shape, --small: the SmolLM2-135M shape; both by default; dummy weights)
and each KV dtype x async setting, requests arrive for a share of --minutes: prompts of any length
up to max_model_len, shared prefixes, groups of n > 1 with one prompt, greedy and sampled
settings (penalties, logprobs, min_tokens, stop ids), aborts at random moments. The KV cache is
kept small (a few max_model_len's worth) so preemption and prefix eviction happen too. Then the
arrivals stop and the engine drains. Checked: no step raised and the engine is alive, every
request ended with a finish_reason (none "error"), and every KV page is free once the prefix
cache is dropped. One summary line per run; exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from homelab_llm.engine.args import EngineArgs  # noqa: E402
from homelab_llm.engine.core import LLMEngine  # noqa: E402
from homelab_llm.engine.sampling_params import SamplingParams  # noqa: E402

CONFIGS = REPO / "assets" / "model_configs"
MODELS = {"large": CONFIGS / "Qwen3-8B.json", "small": CONFIGS / "SmolLM2-135M.json"}


@dataclass
class SoakResult:
    name: str
    requests: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish: Counter = field(default_factory=Counter)
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    def line(self) -> str:
        reasons = " ".join(f"{k}={v}" for k, v in sorted(self.finish.items()))
        verdict = "OK" if not self.failures else "FAIL: " + "; ".join(self.failures[:3])
        return (f"{self.name:32s} req {self.requests:5d} steps {self.steps:6d} "
                f"in {self.prompt_tokens:8d} out {self.output_tokens:7d} hit {self.prefix_hit_tokens:8d} "
                f"preempt {self.preemptions:4d} {self.seconds:6.1f}s [{reasons}] {verdict}")


class Traffic:
    """The random mix. Deterministic for a seed (arrival times aside)."""

    def __init__(self, rng: random.Random, vocab: int, max_model_len: int) -> None:
        self.rng, self.vocab, self.max_len = rng, vocab, max_model_len
        self.prefixes = [self.tokens(rng.randint(16, max(17, max_model_len // 4))) for _ in range(4)]
        self.count = 0

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def prompt_len(self) -> int:
        r, cap = self.rng.random(), self.max_len - 2
        if r < 0.05:
            return self.rng.randint(max(1, cap // 2), cap)  # up to the whole context
        if r < 0.25:
            return self.rng.randint(1, max(1, min(cap, 4096)))
        return self.rng.randint(1, max(1, min(cap, 256)))

    def params(self, room: int) -> SamplingParams:
        rng = self.rng
        p = SamplingParams(max_tokens=rng.randint(1, max(1, min(room, 128))),
                           ignore_eos=rng.random() < 0.7, seed=rng.randrange(1 << 30))
        kind = rng.random()
        if kind < 0.3:
            p.temperature = 0.0
        else:
            p.temperature, p.top_p = rng.choice([0.5, 0.8, 1.2]), rng.choice([1.0, 0.9, 0.5])
            p.top_k, p.min_p = rng.choice([0, -1, 1, 20, 200]), rng.choice([0.0, 0.0, 0.05])
        if rng.random() < 0.1:
            p.repetition_penalty, p.presence_penalty, p.frequency_penalty = 1.1, 0.5, 0.3
        if rng.random() < 0.1:
            p.logprobs = rng.choice([0, 1, 5])
        if rng.random() < 0.1:
            p.stop_token_ids = [rng.randrange(3, self.vocab)]
            p.min_tokens = min(p.max_tokens, rng.randint(0, 4))
        return p

    def next_group(self) -> list[tuple[str, list[int], SamplingParams]]:
        """One prompt; n copies (n > 1 sometimes, as the server adds for `n`)."""
        n = self.rng.choice([1] * 8 + [2, 4])
        length = self.prompt_len()
        prompt = self.tokens(length)
        if self.rng.random() < 0.4:
            prefix = self.rng.choice(self.prefixes)
            prompt = (prefix + prompt)[:max(length, 1)] if length > len(prefix) else prefix[:length]
        room = self.max_len - len(prompt)
        group = []
        for _ in range(n):
            self.count += 1
            group.append((f"soak-{self.count}", prompt, self.params(room)))
        return group


def soak(engine: LLMEngine, name: str, seconds: float | None, max_steps: int, seed: int,
         abort_rate: float = 0.02) -> SoakResult:
    """Arrivals for `seconds` of wall time (or until max_steps), then a drain; the checks."""
    rng = random.Random(seed)
    traffic = Traffic(rng, engine.model_config.vocab_size, engine.max_model_len)
    result = SoakResult(name)
    open_ids: set[str] = set()
    start = time.monotonic()
    concurrency = max(2, engine.args.max_num_seqs + 4)  # a little queueing beyond the batch
    arriving = True
    drain_steps = 0
    while arriving or engine.has_unfinished_requests():
        if arriving and (result.steps >= max_steps
                         or (seconds is not None and time.monotonic() - start > seconds)):
            arriving = False
        while arriving and len(open_ids) < concurrency:
            for rid, prompt, params in traffic.next_group():
                engine.add_request(rid, prompt, params)
                open_ids.add(rid)
                result.requests += 1
        if open_ids and rng.random() < abort_rate:
            engine.abort_request(rng.choice(sorted(open_ids)))  # queued, prefilling or decoding
        try:
            outputs = engine.step()
        except Exception as exc:  # noqa: BLE001 - the soak's finding
            result.failures.append(f"step raised {type(exc).__name__}: {exc}")
            break
        result.steps += 1
        for out in outputs:
            result.output_tokens += len(out.new_token_ids)
            if out.finished:
                result.finish[out.finish_reason or "none"] += 1
                open_ids.discard(out.request_id)
                if out.finish_reason not in ("stop", "length", "abort"):
                    result.failures.append(f"{out.request_id} ended {out.finish_reason}: {out.error}")
        if not arriving:
            drain_steps += 1
            if drain_steps > 100_000:
                result.failures.append("the engine did not drain")
                break
    result.seconds = time.monotonic() - start
    _check_end(engine, open_ids, result)
    return result


def _check_end(engine: LLMEngine, open_ids: set[str], result: SoakResult) -> None:
    if engine.dead_reason is not None:
        result.failures.append(f"engine dead: {engine.dead_reason}")
    if open_ids:
        result.failures.append(f"{len(open_ids)} request(s) never finished")
    counters = engine.status()["counters"]
    result.prompt_tokens = counters["prompt_tokens"]
    result.preemptions = counters["num_preemptions"]
    result.prefix_hit_tokens = engine.kv.prefix_hit_tokens
    pool = engine.kv.pool
    if engine.kv.radix is not None:
        engine.kv.radix.evict(pool.num_pages)  # what is left held is a leak
    if pool.num_free != pool.num_pages:
        result.failures.append(f"{pool.num_pages - pool.num_free} KV page(s) still held")


def engine_for(model: str, device: str, kv: str, async_on: bool, max_model_len: int,
               max_num_seqs: int, layers: int | None, seed: int,
               hf_overrides: dict | None = None) -> LLMEngine:
    from homelab_llm.engine.model.loader import load_model_config
    from homelab_llm.engine.memory import kv_bytes_per_token

    overrides = {**(hf_overrides or {}), **({"num_hidden_layers": layers} if layers else {})} or None
    config = load_model_config(MODELS[model], "dummy", overrides)
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    per_token = kv_bytes_per_token(config, kv, dtype, 1)
    return LLMEngine(EngineArgs(
        model=str(MODELS[model]), load_format="dummy", device=device, dtype=dtype,
        kv_cache_dtype=kv, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=min(2048, max_model_len), async_scheduling=async_on, seed=seed,
        kv_cache_memory_bytes=per_token * max_model_len * 3,  # small: preemption happens
        hf_overrides=overrides))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--small", action="store_true", help="only the SmolLM2-135M shape")
    which.add_argument("--large", action="store_true", help="only the Qwen3-8B shape")
    ap.add_argument("--minutes", type=float, default=2.0, help="arrival time over all runs")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv", default="int8,bf16", help="KV dtypes, comma-separated")
    ap.add_argument("--async", dest="async_modes", default="on,off", help="on, off or on,off")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: 32768 (large), 8192 (small), 256 with --quick")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--hf-overrides", default=None, metavar="JSON",
                    help="e.g. a yarn rope_scaling to soak past the model's native positions")
    ap.add_argument("--quick", action="store_true",
                    help="tiny: the small model with 2 layers, a step budget instead of minutes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cpu = args.device == "cpu"
    models = ["small"] if args.small or args.quick or cpu else ["large"] if args.large else ["large", "small"]
    kvs = ["fp32" if cpu and k == "bf16" else k for k in args.kv.split(",")]
    modes = [m == "on" for m in args.async_modes.split(",")]
    runs = [(m, kv, a) for m in models for kv in kvs for a in modes]
    seconds = None if args.quick else args.minutes * 60 / len(runs)
    results = []
    for i, (model, kv, async_on) in enumerate(runs):
        max_len = args.max_model_len or (256 if args.quick else 32768 if model == "large" else 8192)
        max_seqs = args.max_num_seqs or (4 if args.quick else 32)
        name = f"{model} kv={kv} async={'on' if async_on else 'off'}"
        try:
            engine = engine_for(model, args.device, kv, async_on, max_len, max_seqs,
                                2 if args.quick else None, args.seed + i,
                                json.loads(args.hf_overrides) if args.hf_overrides else None)
            result = soak(engine, name, seconds, 30 if args.quick else 10**9, args.seed + i)
            engine.shutdown()
        except Exception as exc:  # noqa: BLE001 - a run that cannot start is a failed run
            result = SoakResult(name, failures=[f"{type(exc).__name__}: {exc}"])
        print(result.line(), flush=True)
        results.append(result)
    failed = [r for r in results if r.failures]
    print(f"\nSUMMARY {len(results) - len(failed)}/{len(results)} runs clean")
    if args.json:
        Path(args.json).write_text(json.dumps([{**asdict(r), "finish": dict(r.finish)}
                                               for r in results], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
