"""Reading servers: our /v1/status, and vLLM / SGLang / llama.cpp / homelab Prometheus text."""

from __future__ import annotations

import httpx
import pytest

from homelab_llm.tui.probe import CounterRates, Probe, snapshot_from_metrics, snapshot_from_status
from homelab_llm.tui.prometheus import parse_prometheus
from tui_fakes import FIXTURES, load_status


def metrics(name: str):
    return parse_prometheus((FIXTURES / name).read_text())


def test_status_fixture_maps_every_section() -> None:
    snap = load_status()
    assert snap.source == "status" and snap.ok
    assert len(snap.devices) == 2 and snap.devices[0].weights == 8375238656
    assert (snap.kv_tokens_used, snap.kv_tokens_capacity, snap.kv_dtype) == (187392, 425984, "int8")
    assert (snap.running, snap.waiting) == (3, 1)
    assert snap.prefix_hit_rate == pytest.approx(801536 / 912384, abs=1e-12)
    assert (snap.prompt_tps, snap.generation_tps, snap.ttft_p95) == (2874.5, 96.3, 1.873)


def test_status_device_state_bytes_are_read_and_default_to_zero() -> None:
    hybrid = load_status("status_dual_gpu_hybrid.json")
    assert [d.state for d in hybrid.devices] == [1847328768, 1847328768]
    assert ("state", 1847328768) in hybrid.devices[0].segments(0.5)
    # servers from before hybrid support (and plain models) send no "state" key
    assert [d.state for d in load_status().devices] == [0, 0]


def test_status_with_null_latencies_shows_none() -> None:
    snap = load_status("status_cpu.json")
    assert snap.ttft_p50 is None and snap.prefix_hit_rate is None and snap.kv_usage == 0.0


def test_vllm_metrics() -> None:
    snap = snapshot_from_metrics(metrics("vllm_metrics.txt"), CounterRates(), now=1.0)
    assert snap.source == "vllm" and snap.model == "Qwen/Qwen3-32B-AWQ"
    assert (snap.running, snap.waiting, snap.preemptions) == (4, 2, 3)
    assert snap.kv_tokens_capacity == 8192 * 16 and snap.kv_tokens_used == 8192 * 16 // 4
    assert snap.prefix_hit_rate == pytest.approx(0.75, abs=1e-12)
    # 50th of 100 lies in the (0.1, 0.5] bucket, 40 of its 50 counts in: 0.1 + 0.4 * 40/50
    assert snap.ttft_p50 == pytest.approx(0.42, abs=1e-9)
    assert snap.ttft_p95 == pytest.approx(1.75, abs=1e-9)
    assert snap.prompt_tps is None  # a rate needs two polls


def test_sglang_metrics() -> None:
    snap = snapshot_from_metrics(metrics("sglang_metrics.txt"), CounterRates(), now=1.0)
    assert snap.source == "sglang"
    assert (snap.running, snap.waiting) == (5, 0)
    assert (snap.kv_tokens_used, snap.kv_tokens_capacity) == (40000, 160000)
    assert snap.prefix_hit_rate == 0.62 and snap.generation_tps == 143.5  # gauge until a rate exists
    assert snap.ttft_p50 == pytest.approx(0.2, abs=1e-9)


def test_llamacpp_metrics() -> None:
    snap = snapshot_from_metrics(metrics("llamacpp_metrics.txt"), CounterRates(), now=1.0)
    assert snap.source == "llama.cpp"
    assert (snap.running, snap.waiting) == (2, 1)
    assert (snap.kv_tokens_used, snap.kv_tokens_capacity) == (16384, 32768)
    assert (snap.prompt_tps, snap.generation_tps) == (140.26, 25.9)
    assert snap.prefix_hit_rate is None


def test_rates_come_from_counter_deltas() -> None:
    rates = CounterRates()
    text = (FIXTURES / "homelab_metrics.txt").read_text()
    first = snapshot_from_metrics(parse_prometheus(text), rates, now=10.0)
    later = text.replace("prompt_tokens_total{model_name=\"smollm2\"} 1000",
                         "prompt_tokens_total{model_name=\"smollm2\"} 1400")
    second = snapshot_from_metrics(parse_prometheus(later), rates, now=12.0)
    assert first.prompt_tps is None
    assert second.prompt_tps == pytest.approx(200.0, abs=1e-9)
    assert second.generation_tps == 0.0
    restarted = snapshot_from_metrics(parse_prometheus(text), rates, now=13.0)
    assert restarted.prompt_tps is None  # counter went backwards: the server restarted


def test_unknown_metrics_and_odd_lines() -> None:
    snap = snapshot_from_metrics(parse_prometheus("garbage line\nfoo_total 3\n"), CounterRates(), 1.0)
    assert not snap.ok and "no vLLM" in snap.error


def _transport(routes: dict[str, tuple[int, str]]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        code, body = routes.get(request.url.path, (404, "not found"))
        return httpx.Response(code, text=body)
    return httpx.MockTransport(handle)


def test_probe_prefers_status_then_falls_back_to_metrics() -> None:
    status = (FIXTURES / "status_cpu.json").read_text()
    probe = Probe("http://srv", transport=_transport({"/v1/status": (200, status)}))
    assert probe.poll().source == "status"
    vllm = (FIXTURES / "vllm_metrics.txt").read_text()
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(200, text=vllm) if request.url.path == "/metrics" else httpx.Response(404)

    probe = Probe("http://srv", transport=httpx.MockTransport(handle))
    assert probe.poll().source == "vllm" and probe.poll().source == "vllm"
    assert seen == ["/v1/status", "/metrics", "/metrics"]  # learnt once that there is no status


def test_probe_reports_unreachable_server() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    snap = Probe("http://127.0.0.1:9", transport=httpx.MockTransport(refuse)).poll()
    assert not snap.ok and snap.error == "no server at http://127.0.0.1:9"
    bad = Probe("http://srv", transport=_transport({"/v1/status": (500, "boom"), "/metrics": (500, "")}))
    assert "HTTP 500" in bad.poll().error


def test_status_spec_decode_reaches_the_dashboard() -> None:
    from rich.console import Console

    from homelab_llm.tui.widgets.engine_stats import stats_table

    snap = snapshot_from_status({"spec_decode": {"acceptance_rate": 0.75, "mean_accepted_length": 3.25}})
    assert snap.spec_acceptance_rate == 0.75 and snap.spec_mean_accepted_length == 3.25
    console = Console(width=100, record=True)
    console.print(stats_table(snap))
    text = console.export_text()
    assert "Spec accept" in text and "3.25 tok/step" in text
    console = Console(width=100, record=True)
    console.print(stats_table(snapshot_from_status({})))
    assert "Spec accept" not in console.export_text()
