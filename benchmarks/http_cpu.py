"""What the HTTP side costs per token, without a GPU: `serve`'s app (engine in its own process) over
a null engine (benchmarks/null_engine.py: tokens at a fixed pace, the real SmolLM2 tokenizer and
output processor), streamed by a lean raw-socket client, for this checkout and optionally a
baseline checkout (`git archive REF`) in the same run, alternating.

    python3 benchmarks/http_cpu.py [--baseline REF] [--streams 1 8 32] [--rates 540 3982 4055]
        [--tokens 256] [--min-tokens 4096] [--no-continuous-usage]

Per stream count it runs the engine paced at the given aggregate rate (default: the H200's offline
SmolLM2-shape rates at 1/8/32 streams, the issue-19 target) and then unpaced, and reports:
- HTTP ms/1k: CPU time of the server process (the HTTP side: parse, decode, SSE) per 1,000
  streamed tokens, from /proc (robust on a shared machine: CPU time, not wall time);
- engine ms/1k: the same for the engine process (its per-token host work: output processing and
  the pipe; a null step costs nothing else);
- ceiling: 1e6 / HTTP ms/1k, the token rate at which the HTTP process would fill one core;
- paced lost: delivered vs paced decode rate (wall time: noisy on a busy machine);
- unpaced tok/s: what the whole pipeline delivers with no model, from the requests sent to the last
  byte (engine, server and client share this machine's cores, so it understates a bigger box),
  and both processes' CPU per 1k tokens then;
- offline: the null engine stepped in this process with no server (its text decoded, as offline
  LLMEngine does): engine ms/1k above minus this is what the split costs the engine's loop.
Every request asks for the same as server_overhead.py's (temperature 0, ignore_eos, include_usage
and continuous_usage_stats), so the costs are those of the GPU run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


# ---- the server child ---------------------------------------------------------------------------

def serve_child(root: str, port: int) -> int:
    """`http_cpu.py --serve ROOT PORT`: the checkout at ROOT's app over the null engine."""
    sys.path[:0] = [root, str(BENCH)]
    import functools

    import null_engine
    from homelab_llm.server.app import build_app
    from homelab_llm.server.launch import serve
    from homelab_llm.server.state import ServerConfig

    app = build_app(ServerConfig(("null",)), functools.partial(null_engine.NullEngine),
                    engine_process=True)
    return serve(app, "127.0.0.1", port, log_level="warning")


@dataclass
class Server:
    label: str
    child: subprocess.Popen
    port: int
    engine_pid: int = 0


def start_server(label: str, root: Path) -> Server:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    child = subprocess.Popen([sys.executable, str(BENCH / "http_cpu.py"), "--serve", str(root),
                              str(port)], cwd=root, env=env, stdout=subprocess.DEVNULL)
    return Server(label, child, port)


def wait_ready(server: Server, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.child.poll() is not None:
            raise SystemExit(f"{server.label}: the server exited ({server.child.returncode})")
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=1) as conn:
                conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                if b" 200 " in conn.recv(4096):
                    server.engine_pid = engine_pid(server.child.pid)
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{server.label}: not ready in {timeout_s:.0f} s")


def engine_pid(server_pid: int) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == server_pid and b"spawn_main" in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except OSError:
            continue
    raise SystemExit(f"no engine process under {server_pid}")


def cpu_s(pid: int) -> float:
    """CPU time of every live thread of `pid`, in ns resolution (schedstat) where the kernel has
    it, else in clock ticks (which would blur the engine's few ms per run)."""
    try:
        ns = sum(int((task / "schedstat").read_text().split()[0])
                 for task in Path(f"/proc/{pid}/task").iterdir())
    except (OSError, ValueError):
        ns = 0
    if ns:
        return ns / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime + stime, dead threads' too


# ---- the client ---------------------------------------------------------------------------------

@dataclass
class StreamResult:
    sent: float
    first: float  # when the first token's chunk arrived
    last: float  # when [DONE] arrived
    tokens: int


USAGE = re.compile(rb'"completion_tokens":(\d+)')


async def one_stream(port: int, body: bytes) -> StreamResult:
    """Raw HTTP/1.1: the client reads bytes and looks only at the last usage, so its own cost
    per token is a fraction of the server's."""
    sent = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nConnection: close\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    first = 0.0
    tail = b""
    while chunk := await reader.read(1 << 16):
        now = time.perf_counter()
        if not first and b"data: " in chunk:
            first = now
        tail = (tail + chunk)[-4096:]
        last = now
    writer.close()
    if b"data: [DONE]" not in tail or b'"error"' in tail:
        raise SystemExit(f"a stream failed: {tail[-800:]!r}")
    return StreamResult(sent, first, last, int(USAGE.findall(tail)[-1]))


async def run_streams(port: int, n: int, tokens: int, pace_us: int, continuous: bool,
                      salt: str) -> list[StreamResult]:
    def body(i: int) -> bytes:
        return json.dumps({
            "model": "null", "prompt": f"pace {pace_us} [{salt}-{i}] hello", "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": continuous}}).encode()
    return list(await asyncio.gather(*(one_stream(port, body(i)) for i in range(n))))


@dataclass
class Measure:
    tokens: int = 0
    http_cpu_s: float = 0.0
    engine_cpu_s: float = 0.0
    best_tps: float = 0.0


def measure(server: Server, n: int, tokens: int, pace_us: int, runs: int, continuous: bool,
            m: Measure, salt: str) -> None:
    for r in range(runs):
        h0, e0 = cpu_s(server.child.pid), cpu_s(server.engine_pid)
        results = asyncio.run(run_streams(server.port, n, tokens, pace_us, continuous, f"{salt}.{r}"))
        m.http_cpu_s += cpu_s(server.child.pid) - h0
        m.engine_cpu_s += cpu_s(server.engine_pid) - e0
        m.tokens += sum(x.tokens for x in results)
        # Paced: the decode rate (first token to last). Unpaced, a stream's tokens can all come
        # in one read, so from the request on: tokens / (last byte - first request sent).
        if pace_us:
            span = max(x.last for x in results) - min(x.first for x in results)
            made = sum(x.tokens - 1 for x in results)
        else:
            span = max(x.last for x in results) - min(x.sent for x in results)
            made = sum(x.tokens for x in results)
        m.best_tps = max(m.best_tps, made / span if span > 0 else 0)


def offline_ms_per_1k(n: int, tokens: int, min_tokens: int) -> float:
    """CPU ms per 1k tokens of the null engine stepped here, no server (unpaced)."""
    sys.path.insert(0, str(BENCH))
    import null_engine
    from homelab_llm.engine.sampling_params import SamplingParams

    engine = null_engine.NullEngine()
    done, start = 0, time.process_time()
    while done < 4 * min_tokens:  # process_time ticks: more tokens for the same precision
        for i in range(n):
            engine.add_request(f"{done}-{i}", [1, 2, 3], SamplingParams(max_tokens=tokens,
                                                                        ignore_eos=True))
        while engine.has_unfinished_requests():
            done += sum(len(out.new_token_ids) for out in engine.step())
    return 1e6 * (time.process_time() - start) / done


# ---- main ---------------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", nargs=2, metavar=("ROOT", "PORT"), help=argparse.SUPPRESS)
    p.add_argument("--baseline", default=None, help="a git ref to compare with (e.g. main)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rates", type=float, nargs="+", default=[540.5, 3981.6, 4054.7],
                   help="paced aggregate tok/s per stream count (default: H200 offline SmolLM2)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    p.add_argument("--min-tokens", type=int, default=4096,
                   help="repeat each case until this many tokens were streamed (CPU-time precision)")
    p.add_argument("--no-continuous-usage", action="store_true")
    a = p.parse_args()
    if a.serve:
        return serve_child(a.serve[0], int(a.serve[1]))
    if len(a.rates) != len(a.streams):
        p.error("--rates needs one rate per --streams entry")
    # Imported here, not at the top: the serve child must not put this checkout first on its path.
    from server_overhead import baseline_tree, stop_child

    continuous = not a.no_continuous_usage
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"this": REPO}
        if a.baseline:
            roots[f"base {a.baseline}"] = baseline_tree(a.baseline, Path(tmp))
        servers = [start_server(label, root) for label, root in roots.items()]
        try:
            for server in servers:
                wait_ready(server)
                asyncio.run(run_streams(server.port, 2, 8, 0, continuous, "warmup"))
            rows = []
            for n, rate in zip(a.streams, a.rates):
                runs = max(1, -(-a.min_tokens // (n * a.tokens)))
                pace_us = int(1e6 * n / rate)
                paced = {s.label: Measure() for s in servers}
                free = {s.label: Measure() for s in servers}
                for r in range(runs):  # alternate, so a busy moment hits every checkout alike
                    for s in servers:
                        measure(s, n, a.tokens, pace_us, 1, continuous, paced[s.label], f"p{n}.{r}")
                for r in range(max(1, runs // 2)):
                    for s in servers:
                        measure(s, n, a.tokens, 0, 1, continuous, free[s.label], f"f{n}.{r}")
                for s in servers:
                    m, f = paced[s.label], free[s.label]
                    http = 1e6 * m.http_cpu_s / m.tokens
                    rows.append(f"| {n} | {s.label} | {rate:.0f} | {m.best_tps:.0f} | "
                                f"{100 * (1 - m.best_tps / rate):+.1f}% | {http:.1f} | "
                                f"{1e6 * m.engine_cpu_s / m.tokens:.1f} | {1e6 / http:.0f} | "
                                f"{f.best_tps:.0f} | {1e6 * f.http_cpu_s / f.tokens:.1f} | "
                                f"{1e6 * f.engine_cpu_s / f.tokens:.1f} |")
                    print(rows[-1], flush=True)
                offline = offline_ms_per_1k(n, a.tokens, a.min_tokens)
                rows.append(f"| {n} | offline (no server) | | | | | | | | | {offline:.1f} |")
        finally:
            for server in servers:
                stop_child(server.child)
    print(f"\n{a.tokens} tokens/stream, continuous_usage_stats {continuous}, {os.cpu_count()} CPUs, "
          f"{time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| streams | checkout | paced tok/s | delivered | paced lost | HTTP ms/1k tok | "
          "engine ms/1k tok | HTTP ceiling tok/s | unpaced tok/s | unpaced HTTP ms/1k | "
          "unpaced engine ms/1k |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
