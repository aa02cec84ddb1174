"""Fake vendor libraries with the surface hwcheck uses: pynvml (nvidia-ml-py) and pyamdgpuinfo."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    pass


@dataclass
class FakeNvmlGpu:
    bus_id: str  # NVML form: 8-digit domain
    name: str
    total: int
    used: int
    link: tuple[int, int, int, int]  # current gen, width, max gen, width
    temp: int = 35
    power_mw: int = 30_000
    util: int = 0


@dataclass
class FakeNvml:
    gpus: list[FakeNvmlGpu]
    p2p_ok: bool = False
    fail_init: bool = False
    broken_queries: set[str] = field(default_factory=set)  # function names that raise
    calls: list[str] = field(default_factory=list)
    NVML_TEMPERATURE_GPU: int = 0
    NVML_P2P_CAPS_INDEX_READ: int = 0
    NVML_P2P_STATUS_OK: int = 0
    NVML_P2P_STATUS_NOT_SUPPORTED: int = 5

    def _q(self, name: str, value: Any) -> Any:
        self.calls.append(name)
        if name in self.broken_queries:
            raise NVMLError(f"{name}: Not Supported")
        return value

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.fail_init:
            raise NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        return self._q("nvmlDeviceGetCount", len(self.gpus))

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeNvmlGpu:
        return self._q("nvmlDeviceGetHandleByIndex", self.gpus[i])

    def nvmlDeviceGetPciInfo(self, h: FakeNvmlGpu) -> Any:
        return self._q("nvmlDeviceGetPciInfo", SimpleNamespace(busId=h.bus_id.encode()))

    def nvmlDeviceGetName(self, h: FakeNvmlGpu) -> str:
        return self._q("nvmlDeviceGetName", h.name)

    def nvmlDeviceGetMemoryInfo(self, h: FakeNvmlGpu) -> Any:
        return self._q("nvmlDeviceGetMemoryInfo", SimpleNamespace(total=h.total, used=h.used))

    def nvmlDeviceGetTemperature(self, h: FakeNvmlGpu, sensor: int) -> int:
        return self._q("nvmlDeviceGetTemperature", h.temp)

    def nvmlDeviceGetPowerUsage(self, h: FakeNvmlGpu) -> int:
        return self._q("nvmlDeviceGetPowerUsage", h.power_mw)

    def nvmlDeviceGetUtilizationRates(self, h: FakeNvmlGpu) -> Any:
        return self._q("nvmlDeviceGetUtilizationRates", SimpleNamespace(gpu=h.util, memory=0))

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: FakeNvmlGpu) -> int:
        return self._q("nvmlDeviceGetCurrPcieLinkGeneration", h.link[0])

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: FakeNvmlGpu) -> int:
        return self._q("nvmlDeviceGetCurrPcieLinkWidth", h.link[1])

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: FakeNvmlGpu) -> int:
        return self._q("nvmlDeviceGetMaxPcieLinkGeneration", h.link[2])

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: FakeNvmlGpu) -> int:
        return self._q("nvmlDeviceGetMaxPcieLinkWidth", h.link[3])

    def nvmlDeviceGetP2PStatus(self, a: FakeNvmlGpu, b: FakeNvmlGpu, index: int) -> int:
        status = self.NVML_P2P_STATUS_OK if self.p2p_ok else self.NVML_P2P_STATUS_NOT_SUPPORTED
        return self._q("nvmlDeviceGetP2PStatus", status)


@dataclass
class FakeAmdGpu:
    pci_slot: str
    name: str | None
    vram: int
    used: int
    temp: float = 44.0
    power: float = 61.0
    load: float = 0.25
    broken: bool = False

    @property
    def memory_info(self) -> dict[str, int]:
        return {"vram_size": self.vram, "gtt_size": 64 << 30, "vram_cpu_accessible_size": self.vram}

    def _v(self, value: Any) -> Any:
        if self.broken:
            raise RuntimeError("amdgpu query failed (permission denied)")
        return value

    def query_vram_usage(self) -> int:
        return self._v(self.used)

    def query_temperature(self) -> float:
        return self._v(self.temp)

    def query_power(self) -> float:
        return self._v(self.power)

    def query_load(self) -> float:
        return self._v(self.load)


@dataclass
class FakeAmd:
    gpus: list[FakeAmdGpu]

    def detect_gpus(self) -> int:
        return len(self.gpus)

    def get_gpu(self, i: int) -> FakeAmdGpu:
        return self.gpus[i]


def nvml_4090_pair(p2p: bool = False) -> FakeNvml:
    gpus = [FakeNvmlGpu("00000000:01:00.0", "NVIDIA GeForce RTX 4090", 24 << 30, 1 << 30, (1, 8, 4, 16)),
            FakeNvmlGpu("00000000:02:00.0", "NVIDIA GeForce RTX 4090", 24 << 30, 2 << 30, (4, 8, 4, 16))]
    return FakeNvml(gpus, p2p_ok=p2p)
