"""The router over the real engine: two SmolLM2 presets (CPU) on their own ports behind one
router port, called by name through the official openai client; the second starts on demand,
concurrent cold requests share one start, a short ttl unloads, a preset that crashes at start
is a 503 naming it. One module, one router, small max_tokens: a 2-core box runs it in ~30 s."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from homelab_llm.presets import DEFAULT_MODEL, Preset
from homelab_llm.router.app import build_router_app
from homelab_llm.router.pool import Pool
from tests.server.harness import serve_in_thread

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
SMOL_ARGS = {"device": "cpu", "max_model_len": 512, "max_num_seqs": 2,
             "max_num_batched_tokens": 128, "kv_cache_memory_bytes": "32MiB"}
HELLO = [{"role": "user", "content": "Say hi."}]


def smol(name: str, ttl: float = 0.0) -> Preset:
    return Preset(name=name, model=DEFAULT_MODEL, args=dict(SMOL_ARGS), ttl=ttl, startup_timeout=180)


CRASHY = Preset(name="crashy", backend="command", command=(
    "{python}", "-c", "print('loading weights', flush=True); print('boom: no such weights', "
    "flush=True); raise SystemExit(3)"))


@pytest.fixture(scope="module")
def router(smollm2_path):
    pool = Pool([smol("smol-a"), smol("smol-b", ttl=1.0), CRASHY], ttl_s=0)
    app = build_router_app(pool, keepalive_s=0.3, unload_every_s=0.2)
    with serve_in_thread(app, wait_ready=False, timeout=60) as running:
        yield running, pool
    for slot in pool.slots.values():  # lifespan shutdown stopped every child
        assert not slot.manager.status.running


def client_for(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=180, max_retries=0)


def states(base: str) -> dict[str, str]:
    return {k: v["state"] for k, v in httpx.get(base + "/router/status").json().items()}


def test_router_end_to_end(router) -> None:
    running, pool = router
    client = client_for(running.base_url)
    assert sorted(m.id for m in client.models.list().data) == ["crashy", "smol-a", "smol-b"]
    assert set(states(running.base_url).values()) == {"stopped"}

    # two cold requests for smol-a at once: one start, both answered
    with ThreadPoolExecutor(2) as ex:
        replies = list(ex.map(lambda _: client.chat.completions.create(
            model="smol-a", messages=HELLO, max_tokens=3, temperature=0), range(2)))
    assert all(r.choices[0].message.content for r in replies)
    assert sum(line.startswith("$ ") for line in pool.slots["smol-a"].manager.logs) == 1
    assert states(running.base_url) == {"crashy": "stopped", "smol-a": "healthy", "smol-b": "stopped"}

    # smol-b starts on demand; the stream waits with SSE keep-alive comments, then streams
    lines = []
    with httpx.stream("POST", running.base_url + "/v1/chat/completions", timeout=180, json={
            "model": "smol-b", "messages": HELLO, "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[0].startswith(": loading smol-b")
    assert lines[-1] == "data: [DONE]" and any(line.startswith("data: {") for line in lines)
    url_a, url_b = pool.slots["smol-a"].url, pool.slots["smol-b"].url
    assert url_a != url_b and running.base_url not in (url_a, url_b)  # each on its own port
    stream = client.chat.completions.create(model="smol-b", messages=HELLO, max_tokens=3, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    # smol-b has ttl = 1 s: unloaded once idle; smol-a (no ttl) stays up
    deadline = time.monotonic() + 20
    while states(running.base_url)["smol-b"] != "stopped":
        assert time.monotonic() < deadline, "smol-b was not unloaded after its ttl"
        time.sleep(0.2)
    assert states(running.base_url)["smol-a"] == "healthy"

    # a preset that crashes at start: 503 naming it and why; streams get an error event
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="crashy", messages=HELLO, max_tokens=3)
    assert err.value.status_code == 503
    message = err.value.body["message"]
    assert "'crashy'" in message and "exited with code 3" in message and "boom: no such weights" in message
    # an unknown model: 404 listing the presets
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=HELLO, max_tokens=3)
    assert "smol-a" in missing.value.body["message"]
