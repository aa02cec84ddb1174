"""Load progress: the loader reports bytes per shard, the engine its phases, /health shows both
while loading, and the log says each step."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest
import torch

from homelab_llm.engine.model.safetensors_files import safetensors_weights
from homelab_llm.load_progress import LOAD, SPANS, LoadProgress
from tests.server.conftest import fake_server
from tests.server.fake_engine import FakeEngine


def test_phases_only_move_forward() -> None:
    progress = LoadProgress()
    assert progress.snapshot() == {"progress": 0.0, "phase": "starting"}
    progress.weights(50, 100, 1, 2, "a.safetensors")
    start, end = SPANS["loading weights"]
    assert progress.snapshot() == {"progress": round(start + (end - start) / 2, 4),
                                   "phase": "loading weights"}
    progress.weights(10, 100, 1, 2, "a.safetensors")  # a late, smaller report never goes back
    assert progress.fraction == pytest.approx(start + (end - start) / 2)
    progress.begin("capturing graphs")
    progress.step(1, 2, "(batch 8)")
    assert progress.snapshot() == {"progress": 0.95, "phase": "capturing graphs"}
    progress.begin("ready")
    assert progress.fraction == 1.0


def test_safetensors_shards_report_bytes(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(256), "b": torch.zeros(256)}, str(tmp_path / "m-1.safetensors"))
    save_file({"c": torch.zeros(512)}, str(tmp_path / "m-2.safetensors"))
    LOAD.reset()
    seen = []
    with caplog.at_level(logging.INFO, logger="homelab_llm.load"):
        for name, _ in safetensors_weights(tmp_path):
            seen.append((name, LOAD.snapshot()["progress"]))
    assert [p for _, p in seen] == sorted(p for _, p in seen) and seen[-1][1] > seen[0][1]
    assert LOAD.phase == "loading weights"
    shards = [r.getMessage() for r in caplog.records if "shard" in r.getMessage()]
    assert any("shard 1/2 m-1.safetensors" in m for m in shards)
    assert any("shard 2/2 m-2.safetensors" in m for m in shards)


def test_health_says_phase_and_progress_while_loading() -> None:
    release = threading.Event()

    def slow_factory() -> FakeEngine:
        LOAD.reset()
        LOAD.weights(3, 4, 2, 2, "model-00002.safetensors")
        release.wait(10)
        return FakeEngine()

    with fake_server(slow_factory, wait_ready=False) as running:
        deadline = time.monotonic() + 5
        while True:
            body = httpx.get(f"{running.base_url}/health").json()
            if body.get("phase") == "loading weights" or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        start, end = SPANS["loading weights"]
        assert body == {"status": "loading", "phase": "loading weights",
                        "progress": round(start + (end - start) * 0.75, 4)}
        release.set()
