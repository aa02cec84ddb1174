"""Hardware facts for the Hardware screen and the dashboard's GPU headers, from the hwcheck room.

Two sources, both optional: the hwcheck report (GPUs, PCIe links, CPU vs chipset, warnings) read
through `homelab-llm hwcheck --json` in a child process, so a crashing driver library cannot take
the app down; and live sensors (load, temperature, power) read in-process through hwcheck's
vendor backends. Missing pieces become an explanatory `error`, never an exception.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from homelab_llm.tui.snapshot import GpuInfo, GpuTelemetry, HardwareReport, PcieLink

HWCHECK_TIMEOUT_S = 30.0


def _opt_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def parse_hardware_report(data: Mapping[str, Any]) -> HardwareReport:
    """hwcheck JSON (its contract: gpus[{pci_address, vendor, name, integrated, vram_bytes,
    link{current_gen, current_width, max_gen, max_width}, attached_to, numa_node}], topology,
    warnings) -> HardwareReport. Unknown or missing fields are tolerated."""
    gpus = []
    for gpu in data.get("gpus") or []:
        if not isinstance(gpu, Mapping):
            continue
        link = gpu.get("link") if isinstance(gpu.get("link"), Mapping) else {}
        gpus.append(GpuInfo(
            pci_address=str(gpu.get("pci_address", "?")), vendor=str(gpu.get("vendor", "?")),
            name=str(gpu.get("name", "unknown GPU")), vram_bytes=_opt_int(gpu.get("vram_bytes")),
            integrated=bool(gpu.get("integrated", False)),
            link=PcieLink(*(_opt_int(link.get(k)) for k in
                            ("current_gen", "current_width", "max_gen", "max_width"))),
            attached_to=str(gpu.get("attached_to") or ""), numa_node=_opt_int(gpu.get("numa_node"))))
    topology = data.get("topology", "")
    if not isinstance(topology, str):
        topology = _describe_topology(topology)
    warnings = tuple(str(w.get("message", w)) if isinstance(w, Mapping) else str(w)
                     for w in data.get("warnings") or [])
    return HardwareReport(gpus=tuple(gpus), topology=topology, warnings=warnings)


def _describe_topology(topology: Any) -> str:
    if isinstance(topology, Mapping):  # hwcheck's matrices; the per-GPU list is shown as rows
        return "; ".join(f"{k}: {v}" for k, v in topology.items() if v and k != "gpus")
    if isinstance(topology, list):
        return "; ".join(str(item) for item in topology)
    return "" if topology is None else str(topology)


def collect_hardware_report() -> HardwareReport:
    """Run the hardware check in a child process and read its JSON. Blocking: call off the UI."""
    argv = [sys.executable, "-m", "homelab_llm", "hwcheck", "--json"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=HWCHECK_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return HardwareReport(error=f"the hardware check took over {HWCHECK_TIMEOUT_S:g} s")
    except OSError as err:
        return HardwareReport(error=f"cannot run the hardware check: {err}")
    try:
        data = json.loads(done.stdout)
    except json.JSONDecodeError:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return HardwareReport(error=f"hardware check unavailable (exit {done.returncode}): {last}")
    if not isinstance(data, Mapping):
        return HardwareReport(error="the hardware check printed JSON that is not an object")
    return parse_hardware_report(data)


class TelemetryReader:
    """Live GPU sensors through hwcheck's vendor backends (pyamdgpuinfo, NVML), if present."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._started = False
        self.error = ""

    def _start(self) -> None:
        self._started = True
        try:
            from homelab_llm.hwcheck.backends import AUTO, NvmlSession

            self._nvml = NvmlSession(AUTO)
        except Exception as err:  # the hwcheck room is absent or its backend broke
            self.error = f"no live GPU sensors: {err}"

    def read(self) -> dict[str, GpuTelemetry]:
        if not self._started:
            self._start()
        readings: dict[str, Any] = {}
        try:
            from homelab_llm.hwcheck.backends import AUTO, read_amd

            readings.update(read_amd(AUTO))
            if self._nvml is not None and getattr(self._nvml, "ok", False):
                readings.update(self._nvml.read())
        except Exception as err:
            self.error = f"no live GPU sensors: {err}"
            return {}
        return {address: GpuTelemetry(
            pci_address=address, name=r.name or "", load_pct=r.load_pct,
            temp_c=r.temperature_c, power_w=r.power_w) for address, r in readings.items()}

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.close()
            except Exception:
                pass
