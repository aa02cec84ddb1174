"""`homelab-llm bench {depth,concurrency,replay,serve,offline}`: benchmark any OpenAI-compatible
server (ours, vLLM, SGLang, llama.cpp) or the engine directly. Tables go to stdout, a progress bar
to stderr; Ctrl+C cancels the requests in flight and still prints what finished."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from homelab_llm.bench.client import BenchClient, BenchError


def _int_list(text: str) -> tuple[int, ...]:
    """'0,4096,8K' -> (0, 4096, 8192)."""
    out = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        scale = 1024 if part[-1] in "kK" else 1
        try:
            out.append(int(part[:-1] if scale > 1 else part) * scale)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected integers like 0,4096,8K, got {text!r}")
    if not out:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return tuple(out)


def _tokens(text: str) -> int:
    values = _int_list(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one number, got {text!r}")
    return values[0]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmark any OpenAI-compatible server or the engine",
                                   description=__doc__)
    sub = parser.add_subparsers(dest="bench_command", metavar="KIND", required=True)

    def common(p: argparse.ArgumentParser, http: bool = True) -> None:
        if http:
            p.add_argument("--base-url", default="http://127.0.0.1:8000",
                           help="server root or its /v1 URL (default: %(default)s)")
            p.add_argument("--model", default=None, help="model name (default: the server's first)")
            p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                           help="bearer token (default: $OPENAI_API_KEY)")
            p.add_argument("--tokenizer", default=None,
                           help="local tokenizer (GGUF or HF folder) when the server has no /tokenize")
            p.add_argument("--timeout", type=float, default=3600.0, help="per-request seconds")
        p.add_argument("--json", dest="json_path", metavar="FILE", default=None, help="write results as JSON")
        p.add_argument("--markdown", action="store_true", help="print a markdown table")
        p.add_argument("--plot", metavar="DIR", default=None, help="write PNG charts into DIR")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")

    def sweep_flags(p: argparse.ArgumentParser, http: bool = True) -> None:
        p.add_argument("--pp", type=_tokens, default=2048, help="prompt tokens (default: %(default)s)")
        p.add_argument("--tg", type=_tokens, default=128, help="generated tokens (default: %(default)s)")
        p.add_argument("--repetitions", "--runs", type=int, default=3, help="(default: %(default)s)")
        p.add_argument("--mode", choices=["cold", "cached", "both"], default="cold",
                       help="cold: depth prefilled in the timed request; cached: context loaded "
                       "first, then the prompt timed (default: %(default)s)")
        if http:  # offline takes --seed from the engine flags
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--no-cache", action="store_true",
                           help="ask the server not to cache prompts (llama.cpp cache_prompt=false)")
            p.add_argument("--no-warmup", action="store_true")
            p.add_argument("--latency-mode", choices=["api", "none"], default="api",
                           help="api: subtract the GET /v1/models round trip from TTFR")
            p.add_argument("--no-ignore-eos", action="store_true",
                           help="let the model stop early (TG is then an upper bound)")

    p = sub.add_parser("depth", help="pp/tg tok/s and TTFT at context depths (llama-benchy table)")
    common(p)
    sweep_flags(p)
    p.add_argument("--depth", type=_int_list, default=(0,), help="e.g. 0,4096,8192,16K")
    p.add_argument("--concurrency", type=int, default=1, help="streams per measurement")
    p.set_defaults(run=run, bench_run=_run_depth)

    p = sub.add_parser("concurrency", help="c streams at once: TTFT, per-stream and total tok/s")
    common(p)
    sweep_flags(p)
    p.add_argument("--depth", type=_tokens, default=0)
    p.add_argument("--concurrency", type=_int_list, default=(1, 2, 4, 8), help="e.g. 1,2,4,8")
    p.set_defaults(run=run, bench_run=_run_concurrency)

    p = sub.add_parser("replay", help="replay a multi-turn agent session from assets/traces")
    common(p)
    p.add_argument("--trace", default="agent-120k", help="a shipped trace name or a .jsonl path")
    p.add_argument("--list", action="store_true", help="list the shipped traces and exit")
    p.add_argument("--max-turns", type=int, default=None)
    p.add_argument("--salt", default=None,
                   help="session id leading the system prompt (default: random, so runs do not "
                   "share cache); pass '' to replay the exact trace text")
    p.add_argument("--no-ignore-eos", action="store_true")
    p.set_defaults(run=run, bench_run=_run_replay)

    p = sub.add_parser("serve", help="load test: random prompts at a rate or max concurrency")
    common(p)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=_tokens, default=1024)
    p.add_argument("--output-len", type=_tokens, default=128)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s (default: inf)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ignore-eos", action="store_true")
    p.set_defaults(run=run, bench_run=_run_serve)

    p = sub.add_parser("offline", help="the engine directly, no HTTP (GPU runs with dummy weights)")
    p.add_argument("model", nargs="?", default="",
                   help="GGUF file, HF folder, or model_configs JSON with --load-format dummy "
                   "(default: the embedded SmolLM2)")
    common(p, http=False)
    sweep_flags(p, http=False)
    p.add_argument("--depth", type=_int_list, default=(0,))
    p.add_argument("--concurrency", type=_int_list, default=(1,))
    from homelab_llm.engine.args import EngineArgs  # no torch: args.py is plain dataclasses

    EngineArgs.add_cli_args(p)
    p.set_defaults(run=run, bench_run=_run_offline)


def run(args: argparse.Namespace) -> int:
    for path in filter(None, (args.json_path,)):
        _check_writable(Path(path))
    return args.bench_run(args)


def _check_writable(path: Path) -> None:
    """Fail before an hour-long run, not after it."""
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise BenchError(f"--json {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise BenchError(f"--json {path}: not writable")


def _client(args: argparse.Namespace) -> BenchClient:
    return BenchClient(args.base_url, args.model, args.api_key, timeout=args.timeout)


def _drive(report: Any, work: Callable[[], Awaitable[Any]]) -> bool:
    """Run `work`; on Ctrl+C asyncio cancels it (closing in-flight streams) and we keep `report`.
    Returns whether it was interrupted."""
    try:
        asyncio.run(work())
    except KeyboardInterrupt:
        report.interrupted = True
        print("interrupted: in-flight requests cancelled; partial results follow", file=sys.stderr)
    return bool(report.interrupted)


def _emit(args: argparse.Namespace, report: Any, table: str, plot: Callable[[Any, str], list[Path]],
          has_data: bool) -> int:
    print(table)
    if args.json_path:
        from homelab_llm.bench.report import write_json

        write_json(args.json_path, report.to_json())
        print(f"wrote {args.json_path}", file=sys.stderr)
    if args.plot and has_data:
        for path in plot(report, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    if report.interrupted:
        return 130
    return 0 if has_data else 1


def _sweep_options(args: argparse.Namespace) -> Any:
    from homelab_llm.bench.sweep import SweepOptions

    return SweepOptions(repetitions=args.repetitions, no_cache=args.no_cache,
                        ignore_eos=not args.no_ignore_eos, seed=args.seed,
                        warmup=not args.no_warmup, measure_latency=args.latency_mode == "api")


def _run_sweep(args: argparse.Namespace, kind: str, config: Any, runner: Any) -> int:
    from homelab_llm.bench import plots
    from homelab_llm.bench.progress import TerminalProgress
    from homelab_llm.bench.prompts import TokenCounter
    from homelab_llm.bench.report import sweep_table
    from homelab_llm.bench.sweep import SweepReport

    config.points()  # bad sizes fail here, before any request
    report = SweepReport(kind, args.model or "", "")

    async def work() -> None:
        async with _client(args) as client:
            report.target = client.root
            await client.resolve_model()
            counter = await TokenCounter.pick(client, args.tokenizer)
            with TerminalProgress(f"bench {kind}", not args.no_progress) as progress:
                await runner(client, config, report=report, counter=counter, on_progress=progress)

    _drive(report, work)
    has_data = any(r.runs and r.failed < r.runs * r.concurrency for r in report.rows)
    return _emit(args, report, sweep_table(report, args.markdown), plots.plot_sweep, has_data)


def _run_depth(args: argparse.Namespace) -> int:
    from homelab_llm.bench.depth import DepthConfig, run_depth

    config = DepthConfig(pp=args.pp, tg=args.tg, depths=args.depth, repetitions=args.repetitions,
                         mode=args.mode, concurrency=args.concurrency, options=_sweep_options(args))
    return _run_sweep(args, "depth", config, run_depth)


def _run_concurrency(args: argparse.Namespace) -> int:
    from homelab_llm.bench.concurrency import ConcurrencyConfig, run_concurrency

    config = ConcurrencyConfig(pp=args.pp, tg=args.tg, depth=args.depth, levels=args.concurrency,
                               repetitions=args.repetitions, mode=args.mode,
                               options=_sweep_options(args))
    return _run_sweep(args, "concurrency", config, run_concurrency)


def _run_replay(args: argparse.Namespace) -> int:
    from homelab_llm.bench import plots
    from homelab_llm.bench.progress import TerminalProgress
    from homelab_llm.bench.replay import ReplayReport, list_traces, load_trace, run_replay
    from homelab_llm.bench.report import replay_table

    if args.list:
        for name in list_traces():
            trace = load_trace(name)
            print(f"{name}: {len(trace.turns)} turns. {trace.description}")
        return 0
    if args.max_turns is not None and args.max_turns < 1:
        raise BenchError(f"--max-turns must be >= 1, got {args.max_turns}")
    trace = load_trace(args.trace)
    report = ReplayReport(trace.name, args.model or "", "")

    async def work() -> None:
        async with _client(args) as client:
            report.target = client.root
            with TerminalProgress(f"replay {trace.name}", not args.no_progress) as progress:
                await run_replay(client, trace, report=report, salt=args.salt,
                                 ignore_eos=not args.no_ignore_eos, max_turns=args.max_turns,
                                 on_progress=progress)

    _drive(report, work)
    has_data = any(t.error is None for t in report.turns)
    return _emit(args, report, replay_table(report, args.markdown), plots.plot_replay, has_data)


def _run_serve(args: argparse.Namespace) -> int:
    from homelab_llm.bench import plots
    from homelab_llm.bench.progress import TerminalProgress
    from homelab_llm.bench.prompts import TokenCounter
    from homelab_llm.bench.report import serve_table
    from homelab_llm.bench.serve import ServeConfig, ServeReport, run_serve

    config = ServeConfig(num_prompts=args.num_prompts, input_len=args.input_len,
                         output_len=args.output_len, request_rate=args.request_rate,
                         max_concurrency=args.max_concurrency, seed=args.seed,
                         ignore_eos=not args.no_ignore_eos)
    config.validate()
    report = ServeReport(args.model or "", "", config)

    async def work() -> None:
        async with _client(args) as client:
            report.target = client.root
            await client.resolve_model()
            counter = await TokenCounter.pick(client, args.tokenizer)
            with TerminalProgress("bench serve", not args.no_progress) as progress:
                await run_serve(client, config, report=report, counter=counter, on_progress=progress)

    _drive(report, work)
    return _emit(args, report, serve_table(report, args.markdown), plots.plot_serve,
                 bool(report.completed))


def _run_offline(args: argparse.Namespace) -> int:
    from homelab_llm.bench import plots
    from homelab_llm.bench.offline import OfflineConfig, run_offline
    from homelab_llm.bench.progress import TerminalProgress
    from homelab_llm.bench.report import sweep_table
    from homelab_llm.bench.sweep import SweepReport
    from homelab_llm.engine.args import EngineArgs

    config = OfflineConfig(pp=args.pp, tg=args.tg, depths=args.depth, concurrency=args.concurrency,
                           repetitions=args.repetitions, mode=args.mode, seed=args.seed)
    config.points()
    engine_args = EngineArgs.from_cli(args)
    if args.mode != "cold" and not engine_args.enable_prefix_caching:
        raise BenchError("--mode cached needs --enable-prefix-caching")
    from homelab_llm.engine.core import LLMEngine  # torch comes in here, only for offline

    engine = LLMEngine(engine_args)
    report = SweepReport("offline", engine.model_name, "engine")
    try:
        with TerminalProgress("bench offline", not args.no_progress) as progress:
            run_offline(engine, config, report=report, on_progress=progress)
    except KeyboardInterrupt:
        report.interrupted = True
        print("interrupted: requests aborted; partial results follow", file=sys.stderr)
    finally:
        engine.shutdown()
    report.target = f"engine ({engine.device}, {str(engine.dtype).removeprefix('torch.')}, " \
                    f"kv {engine.args.kv_cache_dtype}, tp {engine.args.tensor_parallel_size})"
    has_data = any(r.runs and r.failed < r.runs * r.concurrency for r in report.rows)
    return _emit(args, report, sweep_table(report, args.markdown), plots.plot_sweep, has_data)
