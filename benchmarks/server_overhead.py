"""What the HTTP layer costs: TTFT, inter-token latency and decode tok/s at 1/4/8 concurrent
streams, offline (LLMEngine.step in this process) and over HTTP (`homelab-llm serve` in a child
process, streamed SSE from an async client), in one run on the same machine. The HTTP side runs
in both engine modes: "http-process" (the engine loop in its own process, serve's default) and
"http-thread" (--engine-in-process: the loop in a thread of the server, sharing its GIL).

    python benchmarks/server_overhead.py [MODEL] [--device cpu] [--max-tokens 64]
        [--prompt-words 96] [--streams 1 4 8] [--repeats 2] [--engine-modes process thread]
        [--json out.json]
    python benchmarks/server_overhead.py --gpu-smollm2   # H200: dummy SmolLM2 shape, 1/8/32 streams
    python benchmarks/server_overhead.py --cpu-smoke     # here: embedded SmolLM2, 1/8 streams, short
        [--baseline REF]      # also "http-process@REF": `serve` from `git archive REF`, same run
        [--profile-engine]    # cProfile the engine process's loop and the offline steps; print both

Target (issue 19): HTTP loses <= 5% of offline decode tok/s at 1, 8 and 32 streams on the GPU.

Each request gets a distinct prompt (so the prefix cache does not flatter TTFT), temperature 0
and ignore_eos, so every stream produces exactly --max-tokens tokens. Decode tok/s = tokens after
each stream's first / (last token time - first stream's first token time): the rate the batch
sustains once prefill is done. Steady tok/s counts only the window where every stream is decoding
(from the last stream's first token to the first stream's last): when it matches offline but
decode tok/s does not, the loss is in how the streams start and end (arrival spread, admission),
not in a per-token cost. Offline and HTTP runs alternate and each reports its best of
--repeats (highest decode tok/s), so a busy shared machine penalises both alike. The table printed
at the end is Markdown for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@dataclass
class StreamTiming:
    sent: float
    token_times: list[float] = field(default_factory=list)  # one entry per token received
    # (an SSE chunk may carry more than one token; its tokens share the chunk's time)


@dataclass
class RunResult:
    mode: str  # offline | http-process | http-thread
    streams: int
    ttft_p50_ms: float
    ttft_max_ms: float
    itl_p50_ms: float
    itl_p95_ms: float
    decode_tps: float
    tokens: int
    steady_tps: float = 0.0


def summarize(mode: str, timings: list[StreamTiming]) -> RunResult:
    ttfts = [t.token_times[0] - t.sent for t in timings]
    gaps = [b - a for t in timings for a, b in zip(t.token_times, t.token_times[1:]) if b > a]
    first = min(t.token_times[0] for t in timings)
    last = max(t.token_times[-1] for t in timings)
    after_first = sum(len(t.token_times) - 1 for t in timings)
    q = statistics.quantiles(gaps, n=20) if len(gaps) >= 2 else [0.0] * 19
    return RunResult(mode, len(timings), 1e3 * statistics.median(ttfts), 1e3 * max(ttfts),
                     1e3 * statistics.median(gaps) if gaps else 0.0, 1e3 * q[18],
                     after_first / (last - first) if last > first else 0.0,
                     sum(len(t.token_times) for t in timings), steady_rate(timings))


def steady_rate(timings: list[StreamTiming]) -> float:
    """Tokens per second while every stream decodes: between the last stream's first token and
    the first stream's last (0 when those windows do not overlap)."""
    start = max(t.token_times[0] for t in timings)
    end = min(t.token_times[-1] for t in timings)
    if end <= start:
        return 0.0
    inside = sum(1 for t in timings for x in t.token_times if start < x <= end)
    return inside / (end - start)


def prompts(n: int, words: int, salt: str) -> list[str]:
    base = ("the engine schedules requests in pages and the radix tree shares every token "
            "of a common prefix between agent turns so that long contexts start fast ").split()
    return [f"[{salt}-{i}] " + " ".join(base[(i + k) % len(base)] for k in range(words))
            for i in range(n)]


# ---- offline ------------------------------------------------------------------------------------

def run_offline(engine, n: int, max_tokens: int, words: int, salt: str,
                profile: Any = None) -> RunResult:
    from homelab_llm.engine.sampling_params import SamplingParams

    timings: dict[str, StreamTiming] = {}
    for i, text in enumerate(prompts(n, words, salt)):
        rid = f"{salt}-{i}"
        timings[rid] = StreamTiming(time.perf_counter())
        engine.add_request(rid, text, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                     ignore_eos=True))
    while engine.has_unfinished_requests():
        outputs = profile.runcall(engine.step) if profile is not None else engine.step()
        now = time.perf_counter()
        for out in outputs:
            timings[out.request_id].token_times += [now] * len(out.new_token_ids)
    return summarize("offline", list(timings.values()))


# ---- over HTTP ----------------------------------------------------------------------------------

async def one_stream(client, url: str, model: str, text: str, max_tokens: int) -> StreamTiming:
    # continuous_usage_stats puts the running token count in every chunk, so tokens are counted
    # exactly even when a chunk carries several (or a held-back partial character carries none).
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    timing = StreamTiming(time.perf_counter())
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            now = time.perf_counter()
            if chunk["choices"]:
                count = chunk["usage"]["completion_tokens"] - len(timing.token_times)
                timing.token_times += [now] * count
    return timing


async def run_http_async(base: str, model: str, n: int, max_tokens: int, words: int,
                         salt: str, mode: str = "http") -> RunResult:
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        tasks = [one_stream(client, f"{base}/v1/completions", model, text, max_tokens)
                 for text in prompts(n, words, salt)]
        return summarize(mode, list(await asyncio.gather(*tasks)))


@dataclass
class Server:
    child: subprocess.Popen
    base: str
    log: Any  # its stderr, a temporary file: nobody reads it while it runs (a pipe would fill)


def start_server(model: str, engine_flags: list[str], root: Path = REPO,
                 env: dict[str, str] | None = None) -> Server:
    """`serve` of the checkout at `root` in a child process; wait_ready() before sending it
    anything."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile(mode="w+")
    child = subprocess.Popen(
        [sys.executable, "-m", "homelab_llm", "serve", model, "--port", str(port),
         "--served-model-name", "bench", "--uvicorn-log-level", "warning", *engine_flags],
        cwd=root, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p), **(env or {})},
        stdout=subprocess.DEVNULL, stderr=log, text=True)
    return Server(child, f"http://127.0.0.1:{port}", log)


def baseline_tree(ref: str, into: Path) -> Path:
    """This repository at `ref` (git archive), to serve from."""
    import tarfile
    from io import BytesIO

    data = subprocess.run(["git", "archive", ref], cwd=REPO, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def print_profile(title: str, path: Path) -> None:
    """The top of a cProfile dump: the engine step's mean time, then the costliest functions."""
    import pstats

    stats = pstats.Stats(str(path))
    for (file, _, name), (_, calls, _, cumtime, _) in stats.stats.items():
        if name == "step" and file.endswith("engine/core.py") and calls:
            print(f"\n{title}: LLMEngine.step {calls} calls, {1e3 * cumtime / calls:.3f} ms each "
                  f"(under the profiler)")
    stats.sort_stats("tottime").print_stats(25)


def wait_ready(server: Server, timeout_s: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if server.child.poll() is not None:
            server.log.seek(0)
            raise SystemExit(f"the server exited: {server.log.read()[-4000:]}")
        try:
            if httpx.get(f"{server.base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.child.kill()
            raise SystemExit(f"the server did not become ready in {timeout_s:.0f} s")
        time.sleep(0.2)


def stop_child(child: subprocess.Popen, wait_s: float = 60) -> None:
    """SIGTERM (serve drains and stops its engine), SIGKILL after wait_s."""
    child.terminate()
    try:
        child.wait(wait_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def stop_server(server: Server) -> None:
    stop_child(server.child)
    server.log.close()


# ---- main ---------------------------------------------------------------------------------------

def table(results: list[RunResult]) -> str:
    rows = ["| streams | mode | TTFT p50 (ms) | TTFT max (ms) | ITL p50 (ms) | ITL p95 (ms) "
            "| decode tok/s | HTTP cost | steady tok/s | steady cost |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    offline = {r.streams: r for r in results if r.mode == "offline"}
    for r in results:
        base = offline.get(r.streams)
        cost = (f"{100 * (1 - r.decode_tps / base.decode_tps):+.1f}%"
                if r.mode != "offline" and base and base.decode_tps else "")
        steady = (f"{100 * (1 - r.steady_tps / base.steady_tps):+.1f}%"
                  if r.mode != "offline" and base and base.steady_tps else "")
        rows.append(f"| {r.streams} | {r.mode} | {r.ttft_p50_ms:.1f} | {r.ttft_max_ms:.1f} | "
                    f"{r.itl_p50_ms:.1f} | {r.itl_p95_ms:.1f} | {r.decode_tps:.1f} | {cost} | "
                    f"{r.steady_tps:.1f} | {steady} |")
    return "\n".join(rows)


PRESETS = {  # flag defaults a preset sets (explicit flags still win)
    "gpu_smollm2": dict(model=str(REPO / "assets/model_configs/SmolLM2-135M.json"),
                        load_format="dummy", device="cuda", streams=[1, 8, 32], max_tokens=256,
                        repeats=2),
    "cpu_smoke": dict(device="cpu", streams=[1, 8], max_tokens=16, prompt_words=24, repeats=1),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--device", default=None, help="default cpu")
    parser.add_argument("--load-format", default=None,
                        help="dummy + a model_configs JSON: random weights of a model's shape")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 64")
    parser.add_argument("--prompt-words", type=int, default=None, help="default 96")
    parser.add_argument("--streams", type=int, nargs="+", default=None, help="default 1 4 8")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-memory-bytes", default="256MiB")
    parser.add_argument("--repeats", type=int, default=None, help="default 2")
    parser.add_argument("--engine-modes", nargs="+", choices=["process", "thread"],
                        default=["process", "thread"], help="the server's engine modes to measure")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch threads for both engines (leave cores for the HTTP side)")
    parser.add_argument("--gpu-smollm2", action="store_true",
                        help="preset: dummy SmolLM2-135M shape on CUDA, 1/8/32 streams, 256 tokens")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="preset: embedded SmolLM2 on the CPU, 1/8 streams, 16 tokens, once")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--baseline", default=None,
                        help="a git ref: also measure `serve` (engine process) of that checkout")
    parser.add_argument("--profile-engine", action="store_true",
                        help="cProfile the engine process's loop and the offline steps (slower)")
    args = parser.parse_args()
    defaults = dict(model="", device="cpu", load_format="auto", max_tokens=64, prompt_words=96,
                    streams=[1, 4, 8], repeats=2)
    for name, preset in PRESETS.items():
        if getattr(args, name):
            defaults.update(preset)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main() -> int:
    args = parse_args()
    from homelab_llm.assets import default_model_path
    from homelab_llm.engine.args import EngineArgs, parse_bytes
    from homelab_llm.engine.core import LLMEngine
    from homelab_llm.server.engine_core import PROFILE_ENV

    model = args.model or str(default_model_path())
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)  # the server child's torch
    flags = ["--device", args.device, "--load-format", args.load_format,
             "--max-model-len", str(args.max_model_len),
             "--kv-cache-memory-bytes", args.kv_cache_memory_bytes,
             "--max-num-seqs", str(max(args.streams))]
    results: list[RunResult] = []

    # The servers' engines idle (sleep) while the others run.
    servers: dict[str, Server] = {}
    engine = None
    scratch = tempfile.TemporaryDirectory()
    profile_dump = Path(scratch.name) / "engine.prof"
    offline_profile = None
    if args.profile_engine:
        import cProfile

        offline_profile = cProfile.Profile()
    try:
        for mode in args.engine_modes:  # they load while the offline engine does
            extra = ["--engine-in-process"] if mode == "thread" else []
            env = ({PROFILE_ENV: str(profile_dump)}
                   if args.profile_engine and mode == "process" else None)
            servers[f"http-{mode}"] = start_server(model, flags + extra, env=env)
        if args.baseline:
            root = baseline_tree(args.baseline, Path(scratch.name) / "baseline")
            servers[f"http-process@{args.baseline}"] = start_server(model, flags, root)
        engine = LLMEngine(EngineArgs(model=model, device=args.device, load_format=args.load_format,
                                      max_model_len=args.max_model_len,
                                      kv_cache_memory_bytes=parse_bytes(args.kv_cache_memory_bytes),
                                      max_num_seqs=max(args.streams)))
        for server in servers.values():
            wait_ready(server)
        run_offline(engine, 1, 4, args.prompt_words, "warmup")
        for mode, server in servers.items():
            asyncio.run(run_http_async(server.base, "bench", 1, 4, args.prompt_words, "warmup",
                                       mode))
        for n in args.streams:
            best: dict[str, RunResult] = {}
            for r in range(args.repeats):
                runs = [run_offline(engine, n, args.max_tokens, args.prompt_words, f"off{n}.{r}",
                                    offline_profile)]
                for mode, server in servers.items():
                    runs.append(asyncio.run(run_http_async(
                        server.base, "bench", n, args.max_tokens, args.prompt_words, f"{mode}{n}.{r}",
                        mode)))
                for result in runs:
                    print(table([result]).splitlines()[-1], flush=True)
                    if result.mode not in best or result.decode_tps > best[result.mode].decode_tps:
                        best[result.mode] = result
            results += best.values()
    finally:
        for server in servers.values():
            stop_server(server)
        if engine is not None:
            engine.shutdown()
        if offline_profile is not None and profile_dump.exists():
            offline_dump = Path(scratch.name) / "offline.prof"
            offline_profile.dump_stats(str(offline_dump))
            print_profile("offline", offline_dump)
            print_profile("engine process (http-process)", profile_dump)
        scratch.cleanup()

    results.sort(key=lambda r: (r.streams, r.mode != "offline", r.mode))
    import torch

    print(f"\n{model} ({args.load_format}), device {args.device}, {args.max_tokens} tokens/stream, "
          f"torch threads {torch.get_num_threads()}, "
          f"~{args.prompt_words}-word prompts, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')}\n")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
