"""Short real sweeps on CPU: `homelab-llm serve` with SmolLM2 in a subprocess, llama.cpp's server
when llama-cpp-python[server] is installed, and `bench offline` on a tiny dummy Llama.

Shapes are tiny (pp 16, tg 4, depths 0 and 256) because the CPU engine on a shared 2-core box
prefills ~25 tok/s. Only token accounting is asserted, never speed: the box's load varies."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from homelab_llm.bench.client import BenchClient
from homelab_llm.bench.depth import DepthConfig, run_depth
from homelab_llm.bench.replay import Trace, TurnSpec, run_replay
from homelab_llm.bench.serve import ServeConfig, run_serve
from homelab_llm.bench.sweep import SweepOptions
from homelab_llm.cli import main

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(cmd: list[str], port: int, log: Path, ready_path: str, timeout: float = 240) -> Iterator[str]:
    """Start a server subprocess, wait until `ready_path` answers 200, always reap it."""
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready in {timeout} s:\n{log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + ready_path, timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def our_server(smollm2_path, tmp_path_factory) -> Iterator[str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "homelab_llm", "serve", str(smollm2_path), "--device", "cpu",
           "--port", str(port), "--max-model-len", "1024", "--uvicorn-log-level", "warning"]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with _server(cmd, port, log, "/health") as url:
        # /health answers "loading" with 200 too on some builds: wait for the model list.
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                    break
            time.sleep(0.5)
        yield url


async def test_depth_cold_and_cached_on_our_server(our_server):
    config = DepthConfig(pp=16, tg=4, depths=(0, 256), repetitions=1, mode="both",
                         options=SweepOptions(warmup=False))
    async with BenchClient(our_server) as client:
        report = await run_depth(client, config)
    assert report.token_source == "server /tokenize" and report.output_token_source == "usage"
    rows = {(r.depth, r.mode): r for r in report.rows}
    assert set(rows) == {(0, "cold"), (256, "cold"), (256, "cached")}
    for r in rows.values():
        assert r.failed == 0, r.errors
        assert r.output_tokens == 4  # ignore_eos honoured: exact TG
        assert r.pp_tps.mean and r.pp_tps.mean > 0 and r.tg_tps.mean and r.tg_tps.mean > 0
    # The chat template adds a few tokens around the sized text (SmolLM2's ChatML: < 40).
    cold = rows[(256, "cold")]
    assert 256 + 16 <= cold.prompt_tokens <= 256 + 16 + 40
    cached = rows[(256, "cached")]
    assert cached.cached_tokens is not None and cached.cached_tokens >= 256
    assert cached.prompt_tokens is not None and 1 <= cached.prompt_tokens <= 16 + 40


async def test_replay_hits_the_prefix_cache_on_our_server(our_server):
    trace = Trace("tiny", "two short turns", seed=3, system_words=60,
                  turns=(TurnSpec(30, 12, 2), TurnSpec(20, 8, 2)))
    async with BenchClient(our_server) as client:
        report = await run_replay(client, trace, salt="t1")
    first, second = report.turns
    assert first.error is None and second.error is None
    # Turn 2 starts with turn 1's whole prompt (token-granular cache: all of it, bar at most
    # the one token the engine recomputes to get logits).
    assert second.cached_tokens >= first.prompt_tokens - 1
    assert second.new_tokens == second.prompt_tokens - second.cached_tokens


async def test_serve_on_our_server(our_server):
    config = ServeConfig(num_prompts=3, input_len=16, output_len=3, max_concurrency=3)
    async with BenchClient(our_server) as client:
        report = await run_serve(client, config)
    m = report.metrics()
    assert m["completed"] == 3 and m["failed"] == 0 and m["output_tokens"] == 9


def test_offline_on_a_tiny_dummy_llama(tmp_path, capsys):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    (tmp_path / "tiny.json").write_text(json.dumps(config))
    rc = main(["bench", "offline", str(tmp_path / "tiny.json"), "--load-format", "dummy",
               "--device", "cpu", "--pp", "16", "--tg", "4", "--depth", "0,32", "--mode", "both",
               "--concurrency", "1,2", "--repetitions", "1", "--kv-cache-memory-bytes", "1MiB",
               "--page-size", "4", "--json", str(tmp_path / "off.json"), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "pp16 @ d32 (cached)" in out and "prompt tokens: exact (token ids)" in out
    rows = json.loads((tmp_path / "off.json").read_text())["results"]
    assert [(r["depth"], r["concurrency"], r["mode"]) for r in rows] == [
        (0, 1, "cold"), (0, 2, "cold"), (32, 1, "cold"), (32, 1, "cached"), (32, 2, "cold"),
        (32, 2, "cached")]
    for r in rows:
        assert r["failed"] == 0 and r["output_tokens"] == 4
        if r["mode"] == "cold":
            assert r["prompt_tokens"] == r["depth"] + 16 and r["cached_tokens"] == 0
        else:  # the load request was context + the prompt's first token
            assert r["cached_tokens"] == 33 and r["prompt_tokens"] == 15


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python[server] is not installed")
async def test_depth_against_llama_cpp_server(smollm2_path, tmp_path):
    port = _free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_path), "--host",
           "127.0.0.1", "--port", str(port), "--n_ctx", "1024"]
    with _server(cmd, port, tmp_path / "llama.log", "/v1/models") as url:
        config = DepthConfig(pp=16, tg=4, depths=(0, 128), repetitions=1,
                             options=SweepOptions(warmup=False))
        async with BenchClient(url) as client:
            report = await run_depth(client, config)
    assert [r.depth for r in report.rows] == [0, 128]
    for r in report.rows:
        assert r.failed == 0, r.errors
        assert r.pp_tps.mean and r.tg_tps.mean and r.output_tokens
