"""Router pieces without the engine: budget arithmetic, claims, GPU swaps and proxying through
a fake upstream (a tiny stdlib server started as a command preset), CLI errors."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from homelab_llm.cli import main
from homelab_llm.engine.memory import plan
from homelab_llm.models.describe import describe_hf
from homelab_llm.presets import Preset
from homelab_llm.router.app import build_router_app
from homelab_llm.router.budget import Running, claim_bytes, evictions
from homelab_llm.router.pool import Pool
from tests.models.model_trees import dense_hf
from tests.server.harness import serve_in_thread

pytestmark = pytest.mark.timeout(60)
GIB = 1 << 30
FAKE = Path(__file__).parent / "fake_upstream.py"


def test_evictions_pick_idle_least_recently_used() -> None:
    running = [Running("a", 4, last_used=10, busy=False), Running("b", 4, last_used=5, busy=False),
               Running("c", 4, last_used=1, busy=True)]
    assert evictions(running, 0, 12) == []  # a CPU preset needs nothing
    assert evictions(running, 4, None) == []  # no budget (no GPU): never swap
    assert evictions(running[:2], 4, 12) == []  # fits beside them
    assert evictions(running, 4, 12) == ["b"]  # the older idle one goes; busy c stays
    assert evictions(running, 8, 12) == ["b", "a"]
    assert evictions(running, 12, 12) is None  # c is busy: wait
    assert evictions(running[:2], 20, 12) == ["b", "a"]  # larger than the budget: whole machine


def test_claims_follow_each_backends_memory_setting(tmp_path: Path) -> None:
    assert claim_bytes(Preset("cpu", model="m", args={"device": "cpu"}), 24 * GIB) == 0
    vllm = Preset("v", backend="vllm", model="m", args={"gpu_memory_utilization": 0.5,
                                                         "tensor_parallel_size": 2})
    assert claim_bytes(vllm, 24 * GIB) == 24 * GIB
    sglang = Preset("s", backend="sglang", model="m", args={"tp_size": 2})
    assert claim_bytes(sglang, 10 * GIB) == int(10 * GIB * 0.88) * 2
    ours = Preset("o", model="m", args={"device": "cuda", "gpu_memory_utilization": 0.8})
    assert claim_bytes(ours, 10 * GIB) == 8 * GIB
    folder = dense_hf(tmp_path / "llama")
    exact = Preset("e", model=str(folder), args={"device": "cuda", "kv_cache_memory_bytes": "1GiB"})
    d = plan(describe_hf(folder).config, gpu_memory_bytes=10 * GIB).per_device[0]
    fixed = d.weights_bytes + d.buffers_bytes + d.activation_bytes + d.graph_bytes + d.other_bytes
    assert claim_bytes(exact, 10 * GIB) == fixed + GIB
    absent = exact.with_changes(model=str(tmp_path / "not-yet.gguf"))  # falls back to utilization
    assert claim_bytes(absent, 10 * GIB) == int(10 * GIB * 0.9)
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"\0" * 1234)
    assert claim_bytes(Preset("l", backend="llama.cpp", model=str(gguf)), GIB) == 1234


def fake(name: str, share: float, key: str = "") -> Preset:
    return Preset(name=name, backend="command", startup_timeout=30,
                  command=("{python}", str(FAKE), "--port", "{port}", "--served", f"up-{name}",
                           "--key", key),
                  args={"gpu_memory_utilization": share, **({"api_key": key} if key else {})})


@pytest.fixture
def router():
    pool = Pool([fake("big1", 0.6), fake("big2", 0.6), fake("small", 0.3), fake("keyed", 0, "sekrit")],
                ttl_s=0,
                gpu_memory=10 * GIB, gpu_budget=10 * GIB)
    with serve_in_thread(build_router_app(pool, default_preset="small"), wait_ready=False) as running:
        yield running.base_url, pool
    assert not any(s.manager.status.running for s in pool.slots.values())


def test_presets_that_cannot_share_the_gpus_swap(router) -> None:
    base, pool = router
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)

    def ask(model: str) -> str:
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}]
                                              ).choices[0].message.content

    def up() -> set[str]:
        return {n for n, s in pool.slots.items() if s.manager.status.running}

    assert ask("big1").endswith("says hi") and up() == {"big1"}
    assert ask("small") and up() == {"big1", "small"}  # 6 + 3 of 10 GiB: together
    assert ask("big2") and up() == {"big2", "small"}  # 6 + 6 > 10: big1 (least recent) swapped out
    assert ask("big1") and up() == {"big1"}  # room for 6 needs both others out
    # the router rewrote `model` to what each server answers to (the fake 404s otherwise)
    stream = client.chat.completions.create(model="big1", messages=[{"role": "user", "content": "hi"}],
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream).endswith("says hi")
    # no `model`: the default preset
    r = httpx.post(base + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert r.status_code == 200 and up() == {"big1", "small"}
    # a preset served with an API key is called with it
    assert ask("keyed").endswith("says hi")
    bad = httpx.post(base + "/v1/chat/completions", content=b"[1]", timeout=30)
    assert bad.status_code == 400 and "JSON object" in bad.json()["error"]["message"]


def test_router_cli_errors_are_one_line(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HOMELAB_LLM_PRESETS_DIR", str(tmp_path))
    monkeypatch.setenv("HOMELAB_LLM_CONFIG", str(tmp_path / "none.toml"))
    assert main(["router", "--preset", "nope"]) == 2
    assert "--preset 'nope' is not a routable preset" in capsys.readouterr().err
    assert main(["router", "--ttl", "-1"]) == 2
    assert "--ttl must be >= 0" in capsys.readouterr().err
    (tmp_path / "none.toml").write_text('default_preset = "ghost"\n')
    assert main(["router"]) == 2
    assert "default_preset 'ghost'" in capsys.readouterr().err
