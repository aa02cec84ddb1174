"""`homelab-llm generate`: a completion printed from a subprocess; bad flags are one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.engine.engine_fixtures import write_config

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "homelab_llm", *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=REPO)


def test_generate_prints_a_completion(tmp_path: Path) -> None:
    model = write_config(tmp_path)
    proc = cli("generate", str(model), "--load-format", "dummy", "--device", "cpu",
               "--prompt", "hello", "--max-tokens", "8", "--kv-cache-memory-bytes", "1MiB")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and proc.stdout.strip() != ""


def test_generate_bad_flag_values_are_one_line_errors(tmp_path: Path) -> None:
    model = write_config(tmp_path)
    proc = cli("generate", str(model), "--load-format", "dummy", "--prompt", "x",
               "--page-size", "12")
    assert proc.returncode == 2
    assert "--page-size must be a power of two" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = cli("generate", str(tmp_path / "missing.gguf"), "--prompt", "x")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "missing.gguf" in proc.stderr
    proc = cli("generate", str(model), "--load-format", "dummy", "--device", "cpu", "--prompt", "x",
               "--max-model-len", "64", "--max-tokens", "100", "--kv-cache-memory-bytes", "1MiB")
    assert proc.returncode == 2 and "context limit of 64" in proc.stderr
