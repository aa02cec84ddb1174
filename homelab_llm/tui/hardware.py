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

from homelab_llm.hwcheck.topology_text import Matrix, TreeGpu, render_matrix, render_tree
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
    if isinstance(topology, Mapping):  # the matrix, drawn by the renderer `hwcheck` prints with
        matrix = Matrix.from_json(topology)
        topology = render_matrix(matrix) if len(matrix.connection) > 1 else ""
    warnings = tuple(str(w.get("message", w)) if isinstance(w, Mapping) else str(w)
                     for w in data.get("warnings") or [])
    return HardwareReport(gpus=tuple(gpus), topology=str(topology or ""), tree=_tree(data),
                          warnings=warnings)


def _tree(data: Mapping[str, Any]) -> str:
    tree_gpus = []
    raw = [g for g in data.get("gpus") or [] if isinstance(g, Mapping) and not g.get("integrated")]
    for index, gpu in enumerate(raw):
        path = gpu.get("path")
        if not isinstance(path, list):
            return ""  # an older hwcheck without paths: no tree rather than a wrong one
        tree_gpus.append(TreeGpu(f"GPU{index} {gpu.get('name', '?')}", str(gpu.get("pci_address")),
                                 str(gpu.get("attached_to") or ""),
                                 tuple(h for h in path if isinstance(h, Mapping))))
    return render_tree(tree_gpus) if tree_gpus else ""


def collect_hardware_report(sysfs_root: str | None = None) -> HardwareReport:
    """Run the hardware check in a child process and read its JSON. Blocking: call off the UI.
    sysfs_root: a recorded tree (demos, tests) instead of this machine; vendor libraries are
    then left out, since they would describe this machine's GPUs, not the tree's."""
    argv = [sys.executable, "-m", "homelab_llm", "hwcheck", "--json"]
    if sysfs_root is not None:
        argv += ["--sysfs-root", sysfs_root, "--no-vendor-libs"]
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
            temp_c=r.temperature_c, power_w=r.power_w, vram_used_bytes=r.vram_used_bytes)
            for address, r in readings.items()}

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.close()
            except Exception:
                pass


class NoTelemetry:
    """No live sensors (a recorded sysfs tree is shown: this machine's would not match it)."""

    def read(self) -> dict[str, GpuTelemetry]:
        return {}

    def close(self) -> None:
        pass
