"""CPU decode and prompt processing on the embedded SmolLM2-135M Q4_1 GGUF: our default flags,
our exact mode (--dtype float32) and llama.cpp (llama-cpp-python, if installed) on the same file.

    python benchmarks/cpu_decode.py [--quick] [--threads 2] [--new-tokens 128] [--prompt 512]

Decode: batch 1, greedy, the time from the first output token to the last. Prompt processing:
one prompt of --prompt tokens, the time to its first token (prefill), prefix cache off. Best of
--repeats runs each. The box this runs on may be shared: numbers move with the neighbours' load.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from homelab_llm.assets import default_model_path  # noqa: E402
from homelab_llm.engine.args import EngineArgs  # noqa: E402
from homelab_llm.engine.core import LLMEngine  # noqa: E402
from homelab_llm.engine.sampling_params import SamplingParams  # noqa: E402

Rates = tuple[float, float]  # (decode tok/s, prompt tok/s)


def prompt_ids(n: int, seed: int) -> list[int]:
    """n ordinary token ids (no special tokens), different per seed so no cache can help."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(200, 40000, (n,), generator=g).tolist()


def ours(dtype: str, threads: int) -> Callable[[list[int], int], Rates]:
    engine = LLMEngine(EngineArgs(model=str(default_model_path()), device="cpu", dtype=dtype,
                                  max_model_len=2048, enable_prefix_caching=False,
                                  kv_cache_memory_bytes=128 << 20))
    torch.set_num_threads(threads)

    def run(prompt: list[int], new_tokens: int) -> Rates:
        engine.add_request(f"r{time.monotonic_ns()}", prompt,
                           SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        start, first_at, n = time.perf_counter(), 0.0, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not n and out.new_token_ids:
                    first_at = time.perf_counter()
                n += len(out.new_token_ids)
        end = time.perf_counter()
        return (n - 1) / (end - first_at), len(prompt) / (first_at - start)

    return run


def llama_cpp(threads: int) -> Callable[[list[int], int], Rates] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(default_model_path()), n_ctx=2048, n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False)

    def run(prompt: list[int], new_tokens: int) -> Rates:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - start
        token = int(llm.scores[llm.n_tokens - 1].argmax())
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = int(llm.scores[llm.n_tokens - 1].argmax())
        return (new_tokens - 1) / (time.perf_counter() - start), len(prompt) / prefill

    return run


def best(run: Callable[[list[int], int], Rates], args: argparse.Namespace) -> Rates:
    run(prompt_ids(16, 0), 4)  # warm up
    decode = prefill = 0.0
    for i in range(args.repeats):
        d, _ = run(prompt_ids(16, 100 + i), args.new_tokens)
        _, p = run(prompt_ids(args.prompt, 200 + i), 2)
        decode, prefill = max(decode, d), max(prefill, p)
    return decode, prefill


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32 new tokens, 128-token prompt, 1 run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.prompt, args.repeats = 32, 128, 1
    rows: list[tuple[str, Rates | None]] = []
    rows.append(("ours, default flags", best(ours("auto", args.threads), args)))
    rows.append(("ours, --dtype float32 (exact)", best(ours("float32", args.threads), args)))
    peer = llama_cpp(args.threads)
    rows.append(("llama.cpp (llama-cpp-python)", best(peer, args) if peer else None))
    print(f"SmolLM2-135M Q4_1, {args.threads} threads, decode batch 1 x {args.new_tokens} "
          f"tokens, prompt {args.prompt} tokens, best of {args.repeats}")
    print(f"{'engine':32} {'decode tok/s':>13} {'prompt tok/s':>13} {'vs llama.cpp':>16}")
    ref = rows[-1][1]
    for name, rates in rows:
        if rates is None:
            print(f"{name:32} {'not installed':>13}")
            continue
        ratio = f"{rates[0] / ref[0]:.2f}x / {rates[1] / ref[1]:.2f}x" if ref else "-"
        print(f"{name:32} {rates[0]:13.1f} {rates[1]:13.1f} {ratio:>16}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
