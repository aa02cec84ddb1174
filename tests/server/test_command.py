"""`homelab-llm serve`: flags, presets as defaults under explicit flags, one-line errors."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from homelab_llm.cli import build_parser
from homelab_llm.errors import HomelabError
from homelab_llm.server.command import resolve_args

REPO = Path(__file__).resolve().parents[2]


def parse(*argv: str):
    argv = ["serve", *argv]
    return resolve_args(build_parser(argv).parse_args(argv))


def test_defaults_and_vllm_spelling() -> None:
    args = parse("m.gguf", "--port", "9001", "--served-model-name", "a", "b", "--api-key", "k",
                 "--max-queue-len", "4", "--kv-cache-memory-bytes", "1GiB", "-tp", "2",
                 "--no-enable-prefix-caching")
    assert (args.model, args.port, args.host) == ("m.gguf", 9001, "127.0.0.1")
    assert args.served_model_name == ["a", "b"] and args.api_key == "k"
    assert args.max_queue_len == 4 and args.kv_cache_memory_bytes == 1 << 30
    assert args.tensor_parallel_size == 2 and args.enable_prefix_caching is False
    assert parse().max_num_seqs == 64 and parse().model == ""


def test_server_limits_and_exposure_flags() -> None:
    default = parse()
    assert default.max_request_body_bytes == 32 << 20 and default.max_seqs_per_request == 256
    assert default.allowed_hosts == "" and default.api_key_file is None
    args = parse("--max-request-body-bytes", "64MiB", "--max-seqs-per-request", "8",
                 "--allowed-hosts", "box.lan,nas.lan", "--api-key-file", "/run/key")
    assert args.max_request_body_bytes == 64 << 20 and args.max_seqs_per_request == 8
    assert args.allowed_hosts == "box.lan,nas.lan" and args.api_key_file == "/run/key"


@pytest.fixture
def presets_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HOMELAB_LLM_PRESETS_DIR", str(tmp_path))
    (tmp_path / "mine.toml").write_text(
        'name = "mine"\nbackend = "builtin"\nmodel = "/models/x.gguf"\nport = 8123\n'
        '[args]\nmax_num_seqs = 7\nkv_cache_dtype = "int8"\nenable_prefix_caching = false\n')
    (tmp_path / "other.toml").write_text(
        'name = "other"\nbackend = "vllm"\nmodel = "Qwen/Qwen3-32B"\nport = 8000\n')
    return tmp_path


def test_preset_supplies_defaults_and_flags_win(presets_dir) -> None:
    args = parse("--preset", "mine")
    assert (args.model, args.port, args.max_num_seqs) == ("/models/x.gguf", 8123, 7)
    assert args.kv_cache_dtype == "int8" and args.enable_prefix_caching is False
    args = parse("other.gguf", "--preset", "mine", "--max-num-seqs", "64", "--port", "9000",
                 "--enable-prefix-caching")
    # Explicit flags win even when they restate the built-in default (64).
    assert (args.model, args.port, args.max_num_seqs) == ("other.gguf", 9000, 64)
    assert args.enable_prefix_caching is True and args.kv_cache_dtype == "int8"


def test_preset_errors(presets_dir) -> None:
    with pytest.raises(HomelabError, match="vllm"):
        parse("--preset", "other")
    with pytest.raises(HomelabError, match="no preset named 'ghost'"):
        parse("--preset", "ghost")


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "homelab_llm", "serve", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_bad_flags_are_one_line_errors() -> None:
    for argv, needle in ((["--max-queue-len", "0"], "--max-queue-len"),
                         (["--max-num-seqs", "0"], "--max-num-seqs"),
                         (["--port", "70000"], "--port"),
                         (["--max-seqs-per-request", "0"], "--max-seqs-per-request"),
                         (["--max-request-body-bytes", "10"], "--max-request-body-bytes"),
                         (["--api-key-file", "/nonexistent/key"], "--api-key-file")):
        done = run_cli(*argv)
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("homelab-llm serve: error:"), done.stderr
        assert needle in lines[0]


def test_model_that_fails_to_load_exits_with_one_line(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = run_cli(str(tmp_path / "missing.gguf"), "--port", str(port), "--device", "cpu")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("homelab-llm serve: error: the model failed to load:"), done.stderr
    assert "missing.gguf" in last


def test_serve_module_does_not_import_torch() -> None:
    code = ("import sys; from homelab_llm.cli import build_parser; build_parser(['serve']); "
            "assert 'torch' not in sys.modules and 'fastapi' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
