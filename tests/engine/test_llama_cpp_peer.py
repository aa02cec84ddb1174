"""benchmarks/llama_cpp_peer.py: finding the llama.cpp binary and reading its JSON, with a fake
binary (a shell script) standing in for llama-bench; no llama.cpp is needed."""

from __future__ import annotations

import importlib.util
import stat
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _peer_module():
    spec = importlib.util.spec_from_file_location("llama_cpp_peer", REPO / "benchmarks" / "llama_cpp_peer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("llama_cpp_peer", module)
    spec.loader.exec_module(module)
    return module


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_finds_the_binary_by_flag_or_env_and_reads_its_rates(tmp_path, monkeypatch):
    peer = _peer_module()
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert peer.find_llama_bench(None) is None
    assert peer.find_llama_bench(str(tmp_path / "missing")) is None
    fake = _script(tmp_path / "bench", f'echo "$@" > {tmp_path / "args"}\n'
                   'echo \'[{"n_prompt": 7, "n_gen": 0, "avg_ts": 300.5},'
                   ' {"n_prompt": 0, "n_gen": 5, "avg_ts": 120.25}]\'\n')
    assert peer.find_llama_bench(str(fake)) == fake
    monkeypatch.setenv("LLAMA_BENCH", str(fake))
    assert peer.find_llama_bench(None) == fake
    name, run = peer.find_peer(tmp_path / "model.gguf", 2)
    assert "bench" in name
    assert run(list(range(7)), 5) == (120.25, 300.5)
    assert (tmp_path / "args").read_text().split() == [
        "-m", str(tmp_path / "model.gguf"), "-t", "2", "-p", "7", "-n", "5", "-r", "1", "-o", "json"]


def test_a_failing_binary_raises_with_its_stderr(tmp_path):
    peer = _peer_module()
    fake = _script(tmp_path / "bench", "echo 'no such model' >&2\nexit 3\n")
    _, run = peer.llama_bench_peer(fake, tmp_path / "model.gguf", 1)
    with pytest.raises(RuntimeError, match="exited 3: no such model"):
        run([1, 2], 3)


def test_the_batched_peer_is_our_mini_bench_and_checks_its_sequence_count(tmp_path, monkeypatch):
    peer = _peer_module()
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    other = _script(tmp_path / "llama-bench", "exit 1\n")
    assert peer.find_batched_peer(tmp_path / "model.gguf", 2, str(other)) is None  # no -b test there
    mini = _script(tmp_path / "llama-mini-bench", f'echo "$@" > {tmp_path / "args"}\n'
                   'echo \'[{"n_prompt": 0, "n_gen": 9, "n_seq": 4, "avg_ts": 410.5}]\'\n')
    run = peer.find_batched_peer(tmp_path / "model.gguf", 2, str(mini))
    assert run(4, 9) == 410.5
    assert (tmp_path / "args").read_text().split() == [
        "-m", str(tmp_path / "model.gguf"), "-t", "2", "-p", "0", "-n", "9", "-b", "4", "-r", "1"]
    with pytest.raises(RuntimeError, match="ran 4 sequences, not 8: rebuild it"):
        run(8, 9)  # an older binary without -b decodes some other count
