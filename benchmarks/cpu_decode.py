"""CPU decode and prompt processing on the embedded SmolLM2-135M Q4_1 GGUF: our default flags,
our exact mode (--dtype float32) and llama.cpp on the same file (benchmarks/llama_cpp_peer.py:
its llama-bench binary via --llama-bench / $LLAMA_BENCH / PATH, else llama-cpp-python; without
either the peer row says "not found").

    python benchmarks/cpu_decode.py [--quick] [--threads 2] [--new-tokens 128] [--prompt 512]
        [--llama-bench PATH] [--no-exact] [--torch-kernel] [--batch 8,32]

--torch-kernel adds our default flags with HOMELAB_LLM_CPU_NATIVE=0 (torch's int4 kernel instead
of our AVX2 one, kernels/q4_native.py), in the same rounds.

Decode: batch 1, greedy, the time from the first output token to the last. Prompt processing:
one prompt of --prompt tokens, the time to its first token (prefill), prefix cache off. --batch:
also decode N sequences at once (16-token prompts, greedy), tok/s in all from the step where every
one has its first token to the last, beside llama_mini_bench's -b test (llama.cpp's llama_decode of
N sequences' tokens a step; build_llama_bench.sh builds it). The
engines take turns, one run each per round, and each keeps its best of --repeats rounds: the box
this runs on may be shared, and alternating spreads the neighbours' load over all of them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
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
from llama_cpp_peer import Rates, find_batched_peer, find_peer  # noqa: E402


def prompt_ids(n: int, seed: int) -> list[int]:
    """n ordinary token ids (no special tokens), different per seed so no cache can help."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(200, 40000, (n,), generator=g).tolist()


def ours(dtype: str, threads: int, native: bool = True) -> tuple[Callable[[list[int], int], Rates],
                                                                   Callable[[int, int], float]]:
    """(one sequence's run: (decode, prompt) tok/s; a batched run: N sequences' decode tok/s)."""
    saved = os.environ.get("HOMELAB_LLM_CPU_NATIVE")
    os.environ["HOMELAB_LLM_CPU_NATIVE"] = "1" if native else "0"  # read while the model loads
    try:
        engine = LLMEngine(EngineArgs(model=str(default_model_path()), device="cpu", dtype=dtype,
                                      max_model_len=2048, enable_prefix_caching=False,
                                      kv_cache_memory_bytes=768 << 20))
    finally:
        if saved is None:
            os.environ.pop("HOMELAB_LLM_CPU_NATIVE")
        else:
            os.environ["HOMELAB_LLM_CPU_NATIVE"] = saved
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

    def batched(seqs: int, new_tokens: int) -> float:
        tag = time.monotonic_ns()
        for s in range(seqs):
            engine.add_request(f"b{tag}-{s}", prompt_ids(16, 300 + s),
                               SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        started: set[str] = set()
        counted, since = 0, 0.0
        while engine.has_unfinished_requests():
            outs = engine.step()
            if len(started) == seqs:
                counted += sum(len(out.new_token_ids) for out in outs)
            else:
                started.update(out.request_id for out in outs if out.new_token_ids)
                since = time.perf_counter()
        return counted / (time.perf_counter() - since)

    return run, batched


def best_alternating(runs: list[Callable[[list[int], int], Rates]],
                     args: argparse.Namespace) -> list[Rates]:
    """Each engine's best (decode, prompt) over --repeats rounds, one run of each per round."""
    for run in runs:
        run(prompt_ids(16, 0), 4)  # warm up
    decode, prefill = [0.0] * len(runs), [0.0] * len(runs)
    for i in range(args.repeats):
        for j, run in enumerate(runs):
            d, _ = run(prompt_ids(16, 100 + i), args.new_tokens)
            _, p = run(prompt_ids(args.prompt, 200 + i), 2)
            decode[j], prefill[j] = max(decode[j], d), max(prefill[j], p)
    return list(zip(decode, prefill))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32 new tokens, 128-token prompt, 1 run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench binary")
    ap.add_argument("--no-exact", action="store_true", help="skip the --dtype float32 row")
    ap.add_argument("--batch", default="", help="also decode these many sequences at once: 8,32")
    ap.add_argument("--torch-kernel", action="store_true",
                    help="add a default-flags row on torch's int4 kernel (HOMELAB_LLM_CPU_NATIVE=0)")
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.prompt, args.repeats = 32, 128, 1
    names = ["ours, default flags"]
    default, default_batched = ours("auto", args.threads)
    runs = [default]
    if args.torch_kernel:
        names.append("ours, torch's int4 kernel")
        runs.append(ours("auto", args.threads, native=False)[0])
    if not args.no_exact:
        names.append("ours, --dtype float32 (exact)")
        runs.append(ours("float32", args.threads)[0])
    peer = find_peer(default_model_path(), args.threads, args.llama_bench)
    if peer is not None:
        try:
            peer[1](prompt_ids(16, 0), 4)
        except (OSError, RuntimeError, ValueError, KeyError, subprocess.TimeoutExpired) as exc:
            print(f"{peer[0]} failed, left out: {exc}")
            peer = None
    if peer is not None:
        names.append(peer[0])
        runs.append(peer[1])
    results = best_alternating(runs, args)
    print(f"SmolLM2-135M Q4_1, {args.threads} threads, decode batch 1 x {args.new_tokens} "
          f"tokens, prompt {args.prompt} tokens, best of {args.repeats} alternating rounds")
    print(f"{'engine':32} {'decode tok/s':>13} {'prompt tok/s':>13} {'vs llama.cpp':>16}")
    ref = results[-1] if peer is not None else None
    for name, rates in zip(names, results):
        ratio = f"{rates[0] / ref[0]:.2f}x / {rates[1] / ref[1]:.2f}x" if ref else "-"
        print(f"{name:32} {rates[0]:13.1f} {rates[1]:13.1f} {ratio:>16}")
    if peer is None:
        print(f"{'llama.cpp':32} {'peer not found':>13} (build one: benchmarks/build_llama_bench.sh)")
    if args.batch:
        batch_table([int(b) for b in args.batch.split(",")], default_batched,
                    find_batched_peer(default_model_path(), args.threads, args.llama_bench), args)
    return 0


def batch_table(sizes: list[int], ours_run: Callable[[int, int], float],
                peer_run: Callable[[int, int], float] | None, args: argparse.Namespace) -> None:
    """Batched decode, ours (default flags) against llama.cpp, best of --repeats alternating rounds."""
    print(f"\nbatched decode, {args.new_tokens} tokens a sequence, tok/s in all")
    print(f"{'sequences':>9} {'ours':>9} {'llama.cpp':>10} {'ratio':>7}")
    for seqs in sizes:
        best_ours = best_peer = 0.0
        for _ in range(args.repeats):
            best_ours = max(best_ours, ours_run(seqs, args.new_tokens))
            if peer_run is not None:
                best_peer = max(best_peer, peer_run(seqs, args.new_tokens))
        peer = f"{best_peer:10.1f} {best_ours / best_peer:6.2f}x" if best_peer else f"{'-':>10} {'-':>7}"
        print(f"{seqs:9d} {best_ours:9.1f} {peer}")


if __name__ == "__main__":
    raise SystemExit(main())
