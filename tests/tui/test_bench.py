"""Bench screen: the form's rules, and sweeps driven from the UI against the scripted SSE server
(tests/bench/fake_openai.py) on 127.0.0.1: rows and bars land, cancel keeps partial rows, errors
are one line, and quitting mid-run closes the requests."""

from __future__ import annotations

import asyncio

import pytest
from textual.widgets import Button, DataTable, Input, Select, Static

from homelab_llm.bench.client import BenchClient
from homelab_llm.tui import bench_job
from homelab_llm.tui.app import HomelabApp
from homelab_llm.tui.bench_form import BenchForm, parse_sizes, validate
from homelab_llm.tui.screens.bench import BenchScreen
from homelab_llm.tui.widgets.bar_chart import BarChart, bar
from tests.bench.fake_openai import FakeOpenAI, FakeTransport, Script, VirtualClock, serve_fake
from tui_fakes import FakeProbe, FakeTelemetry, load_hardware, load_status

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------- form rules

def test_sizes_accept_the_cli_spellings() -> None:
    assert parse_sizes("0, 4K,8k,16384") == (0, 4096, 8192, 16384)
    with pytest.raises(ValueError, match="'4x' is not a whole number"):
        parse_sizes("0,4x")


def test_form_issues_name_their_fields() -> None:
    form = BenchForm(kind="depth", pp="abc", tg="1", points="0,-5", repetitions="0")
    spec, issues = validate(form, "http://127.0.0.1:1")
    assert spec is None
    by_field = {i.field: i.message for i in issues}
    assert by_field["pp"] == "'abc' is not a whole number (sizes like 4096 or 4K)"
    assert "at least 2 (decode speed needs two tokens), got 1" in by_field["tg"]
    assert by_field["points"] == "depths must be >= 0, got [0, -5]"
    assert by_field["repetitions"] == "must be at least 1, got 0"


def test_empty_target_means_the_running_service() -> None:
    spec, issues = validate(BenchForm(kind="concurrency", points="1,2,4", depth="1K"),
                            "http://127.0.0.1:8000")
    assert not issues and spec is not None
    assert spec.target == "http://127.0.0.1:8000" and spec.points == (1, 2, 4) and spec.depth == 1024
    assert spec.total_units == 9
    spec, issues = validate(BenchForm(), None)
    assert spec is None and issues[0].field == "target" and "start a preset (s)" in issues[0].message
    _, issues = validate(BenchForm(target="localhost:8000"), None)
    assert "must start with http://" in issues[0].message


def test_bars_are_exact_to_an_eighth() -> None:
    assert bar(1.0, 1.0, 4) == "████"
    assert bar(0.5, 1.0, 3) == "█▌"  # 12 eighths
    assert bar(0.001, 1.0, 10) == "▏"  # a positive value is never invisible
    assert bar(0.0, 1.0, 10) == "" and bar(None or 0.0, 0.0, 10) == ""


# ---------------------------------------------------------------------------- pilot

def bench_app(url: str | None = None) -> HomelabApp:
    return HomelabApp(probe_factory=FakeProbe([load_status()]), watch_url=url,
                      hardware_source=load_hardware, telemetry=FakeTelemetry(),
                      clock=lambda: 1000.0, poll_interval_s=3600.0, start_mode="bench")


def fill(screen: BenchScreen, **values: str) -> None:
    for name, value in values.items():
        widget = screen.query_one(f"#b-{name}")
        assert isinstance(widget, (Input, Select))
        widget.value = value


async def wait_for(pilot, predicate, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await pilot.pause(0.02)


def status_text(screen: BenchScreen) -> str:
    return str(screen.query_one("#b-status", Static).content)


async def test_depth_sweep_fills_table_and_chart(monkeypatch) -> None:
    # The job's client reaches the scripted server through the virtual-clock transport: its
    # figures are exact on a loaded box (on the wall clock, a slow /v1/models probe could
    # exceed the 8 ms prefill and leave a bar unmeasured).
    server, clock = FakeOpenAI(Script(prefill_per_token=1 / 2048, itl=1 / 512)), VirtualClock()

    def virtual_client(*args, **kwargs) -> BenchClient:
        return BenchClient(*args, **kwargs, transport=FakeTransport(server, clock), clock=clock)

    monkeypatch.setattr(bench_job, "BenchClient", virtual_client)
    async with serve_fake(server) as url:
        app = bench_app(url)  # the watched server is the default target
        async with app.run_test(size=(100, 40)) as pilot:
            screen = app.screen
            assert isinstance(screen, BenchScreen)
            fill(screen, pp="16", tg="5", points="0,32", repetitions="2")
            await pilot.pause()
            await pilot.click("#b-run")
            await wait_for(pilot, lambda: not screen.job.running and screen.report is not None
                           and len(screen.report.rows) == 2)
            await pilot.pause(0.05)
            table = screen.query_one("#b-table", DataTable)
            assert table.row_count == 2
            first = [str(c) for c in table.get_row_at(0)]
            assert first[0] == "d0" and first[4] == "2"
            assert table.border_title == "Results · pp16 tg5"
            assert [str(c) for c in table.get_row_at(1)][0] == "d32"
            chart = screen.query_one(BarChart)
            assert [g.title for g in chart.groups] == ["prompt processing by context depth",
                                                       "generation by context depth"]
            pp_bars, tg_bars = ([v for _, v in g.bars] for g in chart.groups)
            assert pp_bars == pytest.approx([2048.0, 2048.0], rel=1e-9)
            assert tg_bars == pytest.approx([512.0, 512.0], rel=1e-9)
            assert status_text(screen) == "done"
            assert screen.query_one("#b-run", Button).disabled is False
            screen.set_focus(None)
            await pilot.press("y")  # the CLI's markdown table, ready to paste into an issue
            assert "| fake-model | pp16 @ d32 |" in app.clipboard and "tg5" in app.clipboard
    # 2 points x 2 repetitions of 5 tokens (plus the 4-token warmup)
    chats = [r for r in server.requests if r["max_tokens"] == 5]
    assert len(chats) == 4 and all(r["stream"] for r in chats)


async def test_cancel_keeps_the_finished_rows() -> None:
    server = FakeOpenAI(Script(itl=0.03))  # tg 10: ~0.3 s a request
    async with serve_fake(server) as url:
        app = bench_app()
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            fill(screen, kind="concurrency", target=url, pp="8", tg="10", points="1,2,3",
                 repetitions="1")
            await pilot.pause()
            await pilot.press("ctrl+r")
            # the first level (1 stream) lands, then cancel while level 2 is streaming
            await wait_for(pilot, lambda: sum(r["max_tokens"] == 10 for r in server.requests) >= 3)
            await pilot.pause(0.05)
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: not screen.job.running)
            await pilot.pause(0.05)
            assert "cancelled: partial results kept" in status_text(screen)
            assert screen.report.interrupted
            rows = screen.report.rows
            assert 1 <= len(rows) < 3 and rows[0].concurrency == 1 and rows[0].failed == 0
            assert screen.query_one("#b-table", DataTable).row_count == len(rows)
            assert "partial results" in str(screen.query_one("#b-summary", Static).content)
            await wait_for(pilot, lambda: server.aborted >= 1)


async def test_bad_form_and_unreachable_server_are_one_line() -> None:
    app = bench_app()
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.screen
        fill(screen, tg="1")
        await pilot.press("ctrl+r")
        await pilot.pause(0.05)
        issues = str(screen.query_one("#b-issues", Static).content)
        assert "target: no running service" in issues and "tg: must be at least 2" in issues
        assert screen.job is None and screen.query_one("#b-tg").has_class("-invalid")
        fill(screen, tg="4", target="http://127.0.0.1:9")  # discard port: connection refused
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: screen.job is not None and not screen.job.running)
        await pilot.pause(0.05)
        assert status_text(screen).startswith("cannot reach http://127.0.0.1:9")
        assert "\n" not in status_text(screen)
        assert not screen.query_one("#b-issues", Static).display


async def test_replay_turns_from_the_ui() -> None:
    server = FakeOpenAI(Script(itl=0.001))
    async with serve_fake(server) as url:
        app = bench_app(url)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            fill(screen, kind="replay", trace="agent-cpu", turns="3")
            await pilot.pause()
            assert not screen.query_one("#b-pp").display and screen.query_one("#b-trace").display
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: screen.job is not None and not screen.job.running)
            await pilot.pause(0.05)
            table = screen.query_one("#b-table", DataTable)
            assert table.row_count == 3
            turn2 = [str(c) for c in table.get_row_at(1)]
            assert turn2[0] == "2" and int(turn2[2].replace(",", "")) > 0  # turn 2 hit the cache
    assert len(server.requests) == 3


async def test_quitting_mid_sweep_closes_requests() -> None:
    server = FakeOpenAI(Script(itl=0.05))  # 40 tokens: 2 s a request
    async with serve_fake(server) as url:
        app = bench_app(url)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            fill(screen, pp="8", tg="40", points="0", repetitions="3")
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: any(r["max_tokens"] == 40 for r in server.requests))
            job = screen.job
            await pilot.press("ctrl+c")
        assert job is not None and not job.running
        await wait_for_aborted(server)


async def wait_for_aborted(server: FakeOpenAI) -> None:
    for _ in range(200):
        if server.aborted >= 1:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the server never saw the request go away")


# ---------------------------------------------------------------------------- failure reasons

def test_form_checks_the_servers_context_limit() -> None:
    spec, issues = validate(BenchForm(), "http://x", max_model_len=2048)  # pp512 at depth 4K
    assert spec is None and [i.field for i in issues] == ["points"]
    assert "= 4672 tokens is over the server's max_model_len 2048; use depths up to 1472" in \
        issues[0].message
    form = BenchForm(kind="concurrency", points="1,2", depth="4K")
    assert [i.field for i in validate(form, "http://x", max_model_len=2048)[1]] == ["depth"]
    assert [i.field for i in validate(BenchForm(pp="4K"), "http://x", max_model_len=2048)[1]] == ["pp"]
    assert validate(BenchForm(points="0,1K"), "http://x", max_model_len=2048)[0] is not None
    assert validate(BenchForm(), "http://x", max_model_len=None)[0] is not None  # unknown: sent


async def test_bench_defaults_on_a_small_context_are_refused_before_sending() -> None:
    app = HomelabApp(probe_factory=FakeProbe([load_status("status_cpu.json")]),
                     watch_url="http://127.0.0.1:9", hardware_source=load_hardware,
                     telemetry=FakeTelemetry(), clock=lambda: 1000.0, poll_interval_s=3600.0,
                     start_mode="bench")
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.snapshot.ok)
        await pilot.press("ctrl+r")
        await pilot.pause(0.05)
        screen = app.screen
        assert screen.job is None
        assert "use depths up to 1472" in str(screen.query_one("#b-issues", Static).content)


async def test_failed_rows_carry_the_servers_reason() -> None:
    from homelab_llm.bench.report import sweep_table

    server = FakeOpenAI(Script(fail_status=400))
    async with serve_fake(server) as url:
        app = bench_app(url)
        async with app.run_test(size=(100, 40)) as pilot:
            screen = app.screen
            fill(screen, pp="16", tg="5", points="0", repetitions="1")
            await pilot.pause()
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: screen.job is not None and not screen.job.running)
            await pilot.pause(0.05)
            runs = str(screen.query_one("#b-table", DataTable).get_row_at(0)[4])
            assert "failed: HTTP 400: scripted failure" in runs
            assert "error at pp16 tg5 @ d0: HTTP 400: scripted failure" in sweep_table(screen.report)
