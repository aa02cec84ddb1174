"""`homelab-llm bench ...` end to end: tables, JSON, plots, errors as one line, Ctrl+C keeping
partial results. Most run against the scripted server on a real socket (127.0.0.1, ephemeral
port) with real sleeps, so their speed checks carry tolerances; the depth table runs the CLI over
the virtual-clock transport instead and asserts exact figures (the arithmetic itself is pinned
in test_bench_timing.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from homelab_llm.bench import command as bench_command
from homelab_llm.bench.client import BenchClient
from homelab_llm.cli import main
from tests.bench.fake_openai import (FakeOpenAI, FakeServerThread, FakeTransport, Script,
                                     VirtualClock)

ROOT = Path(__file__).resolve().parents[2]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_depth_table_json_markdown_and_plot(tmp_path, capsys, monkeypatch):
    # The CLI's client talks to the scripted server through the virtual-clock transport, so the
    # figures are exact whatever the machine's load: 1/256 s per token is 256 tok/s.
    server, clock = FakeOpenAI(Script(prefill_per_token=1 / 2048, itl=1 / 256)), VirtualClock()

    def virtual_client(*args, **kwargs) -> BenchClient:
        return BenchClient(*args, **kwargs, transport=FakeTransport(server, clock), clock=clock)

    monkeypatch.setattr(bench_command, "BenchClient", virtual_client)
    rc, out, err = run_cli(["bench", "depth", "--base-url", "http://fake/v1", "--pp", "32",
                            "--tg", "8", "--depth", "0,128", "--repetitions", "2",
                            "--json", str(tmp_path / "r.json"), "--markdown",
                            "--plot", str(tmp_path / "plots"), "--no-progress"], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("| model") and "e2e_ttft (ms)" in lines[0]
    assert lines[1].startswith("|:")
    tests = [ln.split("|")[2].strip() for ln in lines[2:6]]
    assert tests == ["pp32", "tg8", "pp32 @ d128", "tg8 @ d128"]
    assert "prompt tokens: server /tokenize" in out and "output tokens: usage" in out
    data = json.loads((tmp_path / "r.json").read_text())
    rows = data["results"]
    assert [(r["depth"], r["concurrency"], r["mode"]) for r in rows] == [(0, 1, "cold"), (128, 1, "cold")]
    for r in rows:
        assert {"pp_tps", "tg_tps", "ttft_s", "pp_tps_std", "ttfr_s", "est_ppt_s"} <= set(r)
        assert r["tg_tps"] == pytest.approx(256.0, rel=1e-12) and r["tg_tps_std"] == 0.0
        assert r["pp_tps"] == pytest.approx(2048.0, rel=1e-12)
        assert r["ttft_s"] == pytest.approx((32 + r["depth"]) / 2048, rel=1e-12)
        assert r["failed"] == 0 and r["prompt_tokens"] == 32 + r["depth"]
    assert (tmp_path / "plots" / "tps_vs_depth.png").stat().st_size > 1000


def test_concurrency_streams_really_overlap(capsys):
    server = FakeOpenAI(Script(prefill_fixed=0.02, itl=0.01))
    with FakeServerThread(server) as fake:
        rc, out, err = run_cli(["bench", "concurrency", "--base-url", fake.url, "--pp", "16",
                                "--tg", "10", "--concurrency", "1,4", "--repetitions", "1",
                                "--no-progress", "--json", "/dev/null"], capsys)
    assert rc == 0, err
    assert "t/s (total)" in out and "t/s per stream" in out
    # Four overlapping streams at up to 100 tok/s each (10 ms sleeps; a loaded box stretches them):
    # the total is four streams' worth, where serial streams would give one's.
    row = [ln for ln in out.splitlines() if ln.split()[1:3] == ["tg10", "4"]][0]
    total = float(row.split()[3])
    per_stream = float(row.split()[6])
    assert 40.0 <= per_stream <= 110.0
    assert total == pytest.approx(4 * per_stream, rel=0.35)


def test_replay_reports_cached_and_new_tokens(tmp_path, capsys):
    server = FakeOpenAI(Script(itl=0.001))
    with FakeServerThread(server) as fake:
        rc, out, err = run_cli(["bench", "replay", "--base-url", fake.url, "--trace", "agent-cpu",
                                "--salt", "", "--json", str(tmp_path / "replay.json"),
                                "--plot", str(tmp_path), "--no-progress"], capsys)
    assert rc == 0, err
    data = json.loads((tmp_path / "replay.json").read_text())
    turns = data["results"]
    assert len(turns) == 6 and turns[0]["cached_tokens"] == 0
    for prev, cur in zip(turns, turns[1:]):
        # The fake caches whole leading messages: everything but the new user message.
        assert cur["cached_tokens"] == cur["prompt_tokens"] - cur["new_tokens"]
        assert cur["cached_tokens"] >= prev["prompt_tokens"]
    assert data["summary"]["ttft_s"]["worst_turn"] in range(1, 7)
    assert "TTFT (ms): mean" in out and "CV" in out
    assert (tmp_path / "replay_ttft_per_turn.png").is_file()


def test_serve_percentiles_and_throughput(tmp_path, capsys):
    # Wall-clock gaps, so the bounds leave room for a loaded box (a 4 ms gap read 7.1 ms on two
    # busy cores): a token gap of 20 ms behind a 300 ms prefill; a TPOT or ITL that took the
    # prefill in would read >= 80 ms.
    server = FakeOpenAI(Script(prefill_fixed=0.3, itl=0.02))
    with FakeServerThread(server) as fake:
        rc, out, err = run_cli(["bench", "serve", "--base-url", fake.url, "--num-prompts", "8",
                                "--input-len", "20", "--output-len", "6", "--max-concurrency", "4",
                                "--json", str(tmp_path / "s.json"), "--no-progress"], capsys)
    assert rc == 0, err
    m = json.loads((tmp_path / "s.json").read_text())["results"][0]
    assert m["completed"] == 8 and m["failed"] == 0 and m["output_tokens"] == 48
    assert 0.015 <= m["tpot_s"]["p50"] < 0.05
    assert 0.015 <= m["itl_s"]["p50"] < 0.05
    assert m["request_throughput"] > 0 and "TTFT" in out and "failed requests" in out
    assert len(server.requests) == 8


def test_failed_requests_are_counted_and_exit_nonzero(capsys):
    with FakeServerThread(FakeOpenAI(Script(fail_status=500))) as fake:
        rc, out, err = run_cli(["bench", "depth", "--base-url", fake.url, "--pp", "8", "--tg", "4",
                                "--repetitions", "1", "--no-warmup", "--no-progress"], capsys)
    assert rc == 1
    assert "failed requests: 1" in out


@pytest.mark.parametrize("argv, message", [
    (["--base-url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9"),
    (["--tg", "1"], "--tg must be >= 2"),
    (["--base-url", "ftp://x"], "--base-url must start with http"),
    (["--json", "/nonexistent-dir/r.json"], "does not exist"),
    (["--mode", "cached"], "--mode cached needs a --depth above 0"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    rc, out, err = run_cli(["bench", "depth", "--no-progress", *argv], capsys)
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unknown_trace_lists_the_shipped_ones(capsys):
    rc, _, err = run_cli(["bench", "replay", "--trace", "nope"], capsys)
    assert rc == 2 and "agent-120k" in err and "agent-cpu" in err


def test_ctrl_c_cancels_in_flight_and_keeps_partial_results(tmp_path):
    # Each request streams 40 tokens at 50 ms: the second repetition is in flight at SIGINT.
    server = FakeOpenAI(Script(itl=0.05))
    with FakeServerThread(server) as fake:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "homelab_llm", "bench", "depth", "--base-url", fake.url,
             "--pp", "8", "--tg", "40", "--repetitions", "3", "--no-warmup", "--latency-mode",
             "none", "--json", str(tmp_path / "partial.json"), "--no-progress"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            # a suite started in the background by a non-interactive shell inherits SIGINT
            # ignored, and so would the CLI: give it the terminal's default, as Ctrl+C finds it
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 60
            while len(server.requests) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.3)  # well inside the 2 s the second request streams
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for _ in range(100):  # the server notices the hang-up on its next tick
            if server.aborted:
                break
            time.sleep(0.02)
    assert proc.returncode == 130, err
    assert "INTERRUPTED" in out and "tg40" in out and "Traceback" not in err
    data = json.loads((tmp_path / "partial.json").read_text())
    assert data["interrupted"] is True and data["results"][0]["runs"] == 1
    assert server.aborted == 1 and len(server.requests) == 2


def test_token_source_falls_back_to_estimate_without_tokenize(capsys):
    with FakeServerThread(FakeOpenAI(Script(tokenize=False))) as fake:
        rc, out, err = run_cli(["bench", "depth", "--base-url", fake.url, "--pp", "16", "--tg", "2",
                                "--repetitions", "1", "--no-progress"], capsys)
    assert rc == 0, err
    assert "prompt tokens: estimate (1 token/word)" in out


def test_token_source_local_tokenizer(smollm2_path, capsys):
    with FakeServerThread(FakeOpenAI(Script(tokenize=False))) as fake:
        rc, out, err = run_cli(["bench", "depth", "--base-url", fake.url, "--pp", "16", "--tg", "2",
                                "--repetitions", "1", "--no-progress",
                                "--tokenizer", str(smollm2_path)], capsys)
    assert rc == 0, err
    assert "prompt tokens: local tokenizer" in out
