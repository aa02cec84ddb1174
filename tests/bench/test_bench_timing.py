"""Timing arithmetic, exactly: the fake server injects delays on a virtual clock and every metric
must come out as the closed-form value. Delays are binary fractions, so the float sums are exact
and the comparisons use ==, except where a division is involved (rel 1e-12)."""

from __future__ import annotations

import pytest

from homelab_llm.bench.client import BenchClient
from homelab_llm.bench.depth import DepthConfig, run_depth
from homelab_llm.bench.concurrency import ConcurrencyConfig, run_concurrency
from homelab_llm.bench.metrics import RequestTiming, aggregate_tg_tps, percentile, cv
from homelab_llm.bench.sweep import SweepOptions
from tests.bench.fake_openai import FakeOpenAI, FakeTransport, Script, VirtualClock

EXACT = dict(rel=1e-12, abs=0.0)


def make_client(script: Script) -> tuple[BenchClient, FakeOpenAI, VirtualClock]:
    clock = VirtualClock()
    server = FakeOpenAI(script)
    client = BenchClient("http://fake/v1", transport=FakeTransport(server, clock), clock=clock)
    return client, server, clock


async def test_one_stream_ttfr_ttft_itl_tpot_e2el():
    script = Script(latency=0.125, prefill_fixed=0.5, first_token_gap=0.0625, itl=0.03125,
                    usage_gap=0.25)
    client, server, _ = make_client(script)
    async with client:
        await client.resolve_model()
        t = await client.stream_chat([{"role": "user", "content": "a b c d"}], max_tokens=9)
    assert t.error is None and t.start == 0.125  # after the /v1/models probe
    assert t.ttfr == 0.125 + 0.5  # the role-only chunk
    assert t.ttft == 0.125 + 0.5 + 0.0625  # the first text
    assert t.itl == [0.03125] * 8
    assert t.output_tokens == 9 and t.output_token_source == "usage"
    assert t.tg_tps == pytest.approx(32.0, **EXACT)  # 8 gaps of 1/32 s
    assert t.e2el == 0.6875 + 8 * 0.03125 + 0.25  # the usage chunk is the last event
    assert t.tpot == pytest.approx((8 * 0.03125 + 0.25) / 8, **EXACT)
    assert t.est_ppt(0.125) == 0.5
    assert t.prompt_tokens == 4 and t.cached_tokens == 0
    assert server.requests[0]["ignore_eos"] is True and server.requests[0]["max_tokens"] == 9


async def test_without_usage_or_role_chunk_counts_chunks():
    script = Script(latency=0.25, prefill_fixed=0.25, itl=0.125, send_usage=False,
                    send_role_chunk=False)
    client, _, _ = make_client(script)
    async with client:
        await client.resolve_model()
        t = await client.stream_chat([{"role": "user", "content": "x"}], max_tokens=5)
    assert t.output_token_source == "chunks" and t.output_tokens == 5
    assert t.ttfr == t.ttft == 0.5  # no empty first chunk: first response is the first token
    assert t.tg_tps == pytest.approx(8.0, **EXACT)
    assert t.e2el == 0.5 + 4 * 0.125


async def test_depth_sweep_rates_match_injected_speeds():
    # Prefill 1/1024 s per prompt token on top of 1/8 s latency; decode 1/64 s per token.
    script = Script(latency=0.125, prefill_per_token=1 / 1024, itl=1 / 64)
    client, server, _ = make_client(script)
    config = DepthConfig(pp=64, tg=16, depths=(0, 256), repetitions=2,
                         options=SweepOptions(warmup=False))
    async with client:
        report = await run_depth(client, config)
    assert report.token_source == "server /tokenize" and report.latency_s == 0.125
    assert [(r.depth, r.mode, r.runs) for r in report.rows] == [(0, "cold", 2), (256, "cold", 2)]
    for row in report.rows:
        prompt = 64 + row.depth  # words == tokens on the fake server; cold = context + prompt
        assert row.prompt_tokens == prompt
        assert row.pp_tps.mean == pytest.approx(1024.0, **EXACT)
        assert row.pp_tps.std == pytest.approx(0.0, abs=1e-9)
        assert row.tg_tps.mean == pytest.approx(64.0, **EXACT)
        assert row.ttfr_s.mean == pytest.approx(0.125 + prompt / 1024, **EXACT)
        assert row.est_ppt_s.mean == pytest.approx(prompt / 1024, **EXACT)
        assert row.failed == 0 and row.output_tokens == 16
    # Fresh text every repetition: no request repeats an earlier one's context.
    contents = [r["messages"][0]["content"] for r in server.requests]
    assert len(set(contents)) == len(contents)


async def test_cached_mode_times_only_the_new_tokens():
    script = Script(latency=0.0, prefill_per_token=1 / 512, itl=1 / 32)
    client, server, _ = make_client(script)
    config = DepthConfig(pp=32, tg=4, depths=(512,), repetitions=1, mode="both",
                         options=SweepOptions(warmup=False, measure_latency=False))
    async with client:
        report = await run_depth(client, config)
    cold, cached = report.rows
    assert (cold.mode, cached.mode) == ("cold", "cached")
    assert cold.cached_tokens == 0 and cold.prompt_tokens == 512 + 32
    assert cached.cached_tokens == 512 and cached.prompt_tokens == 32
    assert cached.ttft_s.mean == pytest.approx(32 / 512, **EXACT)  # only the prompt prefilled
    assert cached.pp_tps.mean == pytest.approx(512.0, **EXACT)
    # Cached mode sent a context-load request (one token out) before the timed one.
    assert [r["max_tokens"] for r in server.requests] == [4, 1, 4]


async def test_concurrency_aggregates_follow_llama_benchy():
    script = Script(latency=0.0, prefill_fixed=0.25, itl=1 / 16)
    client, _, _ = make_client(script)
    config = ConcurrencyConfig(pp=8, tg=5, levels=(1, 2), repetitions=1,
                               options=SweepOptions(warmup=False, measure_latency=False))
    async with client:
        report = await run_concurrency(client, config)
    one, two = report.rows
    assert one.concurrency == 1 and two.concurrency == 2
    assert one.tg_tps.mean == pytest.approx(16.0, **EXACT)
    # The virtual-clock transport serves streams one after another (A: 0 -> 0.5, B: 0.5 -> 1.0),
    # so aggregate decode = 2 * 4 tokens over [A's first token 0.25, B's last token 1.0].
    span = 1.0 - 0.25
    assert two.tg_tps.mean == pytest.approx(8 / span, **EXACT)
    assert two.tg_tps_stream.mean == pytest.approx(16.0, **EXACT)


def test_aggregate_and_summary_arithmetic():
    a = RequestTiming(start=0.0, first_response=1.0, first_token=1.0, token_times=[1.0, 2.0, 3.0],
                      end=3.0, completion_tokens=3)
    b = RequestTiming(start=0.5, first_response=2.0, first_token=2.0, token_times=[2.0, 4.0],
                      end=4.0, completion_tokens=2)
    assert aggregate_tg_tps([a, b]) == (5 - 2) / (4.0 - 1.0)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7, rel=1e-12)
    assert percentile([5.0], 99) == 5.0 and percentile([], 50) is None
    assert cv([2.0, 4.0]) == pytest.approx(1 / 3, rel=1e-12)


async def test_http_error_is_recorded_not_raised():
    client, _, _ = make_client(Script(fail_status=503))
    async with client:
        await client.resolve_model()
        t = await client.stream_chat([{"role": "user", "content": "x"}], max_tokens=4)
    assert not t.ok and t.error == "HTTP 503: scripted failure"
