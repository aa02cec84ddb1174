"""llama.cpp as the CPU peer of benchmarks/cpu_decode.py: its own `llama-bench` binary, or
llama-cpp-python, on the same GGUF file and thread count.

Where the binary comes from: `--llama-bench PATH`, else $LLAMA_BENCH, else `llama-bench` on PATH;
llama.cpp's llama-bench or benchmarks/llama_mini_bench.cpp (the same pp/tg tests and JSON fields
on the public llama.h API). benchmarks/build_llama_bench.sh builds them from llama.cpp's sources
as PyPI ships them (the llama-cpp-python sdist vendors them), natively for this CPU. Without a
binary or llama-cpp-python the peer is "not found" and the benchmark prints our rows alone.

A run returns (decode tok/s, prompt tok/s): llama-bench's tg test (batch 1, from an empty
context) and pp test (one prompt of that many tokens), one repetition each, so the caller can
alternate engines and keep the best of its rounds. Batched decode (find_batched_peer: N sequences
a step, tok/s in all) needs llama_mini_bench's -b (llama-bench has no such test, llama-cpp-python
decodes one sequence).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable

Rates = tuple[float, float]  # (decode tok/s, prompt tok/s)
PeerRun = Callable[[list[int], int], Rates]
BatchedRun = Callable[[int, int], float]  # (sequences, new tokens each) -> tok/s in all
# A 135M model's pp512 + tg128 takes seconds on an idle box; minutes on a crowded one.
RUN_TIMEOUT_S = 300


def find_llama_bench(explicit: str | None = None) -> Path | None:
    for candidate in (explicit, os.environ.get("LLAMA_BENCH"), shutil.which("llama-bench")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def llama_bench_peer(binary: Path, model: Path, threads: int) -> tuple[str, PeerRun]:
    def run(prompt: list[int], new_tokens: int) -> Rates:
        cmd = [str(binary), "-m", str(model), "-t", str(threads), "-p", str(len(prompt)),
               "-n", str(new_tokens), "-r", "1", "-o", "json"]
        rates = {(t["n_prompt"], t["n_gen"]): float(t["avg_ts"]) for t in _bench_json(cmd, binary)}
        return rates[(0, new_tokens)], rates[(len(prompt), 0)]

    return f"llama.cpp ({binary.name})", run


def _bench_json(cmd: list[str], binary: Path) -> list[dict]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{binary.name} exited {done.returncode}: {done.stderr[-500:]}")
    return json.loads(done.stdout)


def find_batched_peer(model: Path, threads: int, llama_bench: str | None = None) -> BatchedRun | None:
    """llama_mini_bench's batched tg test (-b), or None where the binary is not ours (llama.cpp's
    llama-bench has no -b test) or not found."""
    binary = find_llama_bench(llama_bench)
    if binary is None or "mini" not in binary.name:
        return None

    def run(seqs: int, new_tokens: int) -> float:
        cmd = [str(binary), "-m", str(model), "-t", str(threads), "-p", "0", "-n", str(new_tokens),
               "-b", str(seqs), "-r", "1"]
        (test,) = _bench_json(cmd, binary)
        if test.get("n_seq") != seqs:
            raise RuntimeError(f"{binary.name} ran {test.get('n_seq')} sequences, not {seqs}: rebuild it")
        return float(test["avg_ts"])

    return run


def llama_cpp_python_peer(model: Path, threads: int) -> tuple[str, PeerRun] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(model), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False)

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

    return "llama.cpp (llama-cpp-python)", run


def find_peer(model: Path, threads: int, llama_bench: str | None = None) -> tuple[str, PeerRun] | None:
    """The llama-bench binary if one is found, else llama-cpp-python if installed, else None."""
    binary = find_llama_bench(llama_bench)
    if binary is not None:
        return llama_bench_peer(binary, model, threads)
    return llama_cpp_python_peer(model, threads)
