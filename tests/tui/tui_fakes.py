"""Recorded server data and fakes for the probe, the hardware check and the sensors, so screens
render the same every run. (A plain module, imported by name: tests/ is not a package.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from homelab_llm.presets import Preset
from homelab_llm.tui.hardware import parse_hardware_report
from homelab_llm.tui.host import HostReading
from homelab_llm.tui.probe import snapshot_from_status
from homelab_llm.tui.snapshot import GpuTelemetry, HardwareReport, ServerSnapshot

FIXTURES = Path(__file__).parent / "fixtures"
TINY_SERVER = FIXTURES / "tiny_server.py"


def load_status(name: str = "status_dual_gpu.json") -> ServerSnapshot:
    return snapshot_from_status(json.loads((FIXTURES / name).read_text()))


def load_hardware() -> HardwareReport:
    return parse_hardware_report(json.loads((FIXTURES / "hwcheck.json").read_text()))


class FakeProbe:
    """Replays fixed snapshots, the last one forever; counts its polls."""

    def __init__(self, snapshots: list[ServerSnapshot]) -> None:
        self.snapshots = snapshots
        self.polls = 0

    def __call__(self, url: str) -> FakeProbe:  # used as the app's probe_factory
        self.url = url
        return self

    def poll(self) -> ServerSnapshot:
        snap = self.snapshots[min(self.polls, len(self.snapshots) - 1)]
        self.polls += 1
        return snap

    def close(self) -> None:
        pass


class FakeTelemetry:
    def __init__(self, readings: dict[str, GpuTelemetry] | None = None) -> None:
        self.readings = readings or {}

    def read(self) -> dict[str, GpuTelemetry]:
        return self.readings

    def close(self) -> None:
        pass


class FakeHost:
    """Fixed CPU/RAM figures, so screens that show them render the same every run."""

    def __init__(self, reading: HostReading | None = None) -> None:
        self.reading = reading or HostReading(cpu_pct=23.0, ram_used=12 << 30, ram_total=64 << 30,
                                              child_cpu_pct=180.0, child_rss=3 << 30)

    def read(self, child_pid: int | None) -> HostReading:
        return self.reading


FIXED_TELEMETRY = {
    "0000:03:00.0": GpuTelemetry("0000:03:00.0", load_pct=97, temp_c=71, power_w=312),
    "0000:0c:00.0": GpuTelemetry("0000:0c:00.0", load_pct=95, temp_c=66, power_w=298),
}


def tiny_preset(name: str, port: int, *extra: str, pidfile: Path | None = None,
                timeout: float = 30.0) -> Preset:
    command = ["{python}", str(TINY_SERVER), "--port", "{port}", *extra]
    if pidfile is not None:
        command += ["--pidfile", str(pidfile)]
    return Preset(name=name, backend="command", command=tuple(command), port=port,
                  startup_timeout=timeout)


def crash_preset(port: int) -> Preset:
    # The reason first, then the shutdown noise a server prints on its way out (as uvicorn does).
    code = ("print('loading model...'); print('fatal: out of memory'); "
            "print('INFO:     Waiting for application shutdown.'); "
            "print('INFO:     Finished server process [4242]', flush=True); raise SystemExit(1)")
    return Preset(name="crasher", backend="command", command=("{python}", "-c", code), port=port)


PYTHON = sys.executable


def depth_report():
    """A finished depth sweep with round numbers (2x 7900 XTX-like), for the Bench snapshot."""
    from homelab_llm.bench.metrics import Stat
    from homelab_llm.bench.sweep import BenchRow, SweepReport

    report = SweepReport("depth", "qwen3-32b-awq", "http://127.0.0.1:8000",
                         token_source="server /tokenize", output_token_source="usage",
                         latency_s=0.0012, date="2025-06-01T12:00:00")
    for depth, pp, tg, ttft in ((0, 2210.0, 41.8, 0.93), (4096, 1964.0, 38.2, 3.17),
                                (16384, 1502.5, 33.1, 12.4), (65536, 811.0, 22.7, 83.2)):
        report.rows.append(BenchRow(
            mode="cold", depth=depth, pp=2048, tg=128, concurrency=1, runs=3, failed=0,
            pp_tps=Stat(pp, pp * 0.01, 3), tg_tps=Stat(tg, 0.2, 3), tg_tps_stream=Stat(tg, 0.2, 3),
            ttfr_s=Stat(ttft - 0.02, 0.01, 3), est_ppt_s=Stat(ttft - 0.03, 0.01, 3),
            ttft_s=Stat(ttft, 0.01, 3), prompt_tokens=2048 + depth, cached_tokens=0,
            output_tokens=128))
    return report
