"""Recorded server data and fakes for the probe, the hardware check and the sensors, so screens
render the same every run. (A plain module, imported by name: tests/ is not a package.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from homelab_llm.presets import Preset
from homelab_llm.tui.hardware import parse_hardware_report
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
    code = "print('loading model...'); print('fatal: out of memory', flush=True); raise SystemExit(1)"
    return Preset(name="crasher", backend="command", command=("{python}", "-c", code), port=port)


PYTHON = sys.executable
