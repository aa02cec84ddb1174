"""Optional vendor libraries: pyamdgpuinfo (AMD) and NVML (`nvidia-ml-py`, imported as pynvml).

Both are imported lazily and every call is guarded: a missing library, an unloaded driver, a
permission error or an old library without some query yields fewer fields, never an exception.
Tests pass fake modules with the same surface.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from homelab_llm.hwcheck.sysfs import normalize_bdf

AUTO: Any = object()  # "import the real library if it is installed"; None means "do not use it"


@dataclass
class VendorReading:
    """What a vendor library told us about one GPU (None: it did not say)."""

    source: str
    name: str | None = None
    vram_bytes: int | None = None
    vram_used_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    load_pct: float | None = None
    link: dict[str, int | None] = field(default_factory=dict)  # NVML current/max gen/width


def load_module(module: Any, name: str) -> Any:
    if module is not AUTO:
        return module
    try:
        return importlib.import_module(name)
    except Exception:  # ImportError, or a broken native extension
        return None


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # vendor libraries raise their own error types for "not supported"
        return None


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return str(value) if value not in (None, "") else None


def read_amd(module: Any) -> dict[str, VendorReading]:
    """pyamdgpuinfo readings keyed by PCI address."""
    lib = load_module(module, "pyamdgpuinfo")
    count = _try(lambda: int(lib.detect_gpus())) if lib is not None else None
    out: dict[str, VendorReading] = {}
    for index in range(count or 0):
        gpu = _try(lambda: lib.get_gpu(index))
        address = normalize_bdf(_text(getattr(gpu, "pci_slot", None)) or "") if gpu else None
        if gpu is None or address is None:
            continue
        memory = _try(lambda: dict(gpu.memory_info)) or {}
        load = _try(gpu.query_load)
        out[address] = VendorReading(
            source="pyamdgpuinfo",
            name=_text(getattr(gpu, "name", None)),
            vram_bytes=memory.get("vram_size"),
            vram_used_bytes=_try(gpu.query_vram_usage),
            temperature_c=_try(gpu.query_temperature),
            power_w=_try(gpu.query_power),
            load_pct=round(load * 100.0, 1) if isinstance(load, (int, float)) else None,
        )
    return out


class NvmlSession:
    """An initialised NVML with handles by PCI address; `close()` shuts NVML down again."""

    def __init__(self, module: Any) -> None:
        self.lib = load_module(module, "pynvml")
        self.handles: dict[str, Any] = {}
        self.ok = False
        if self.lib is None or not self._inited():
            return
        self.ok = True
        for index in range(_try(self.lib.nvmlDeviceGetCount) or 0):
            handle = _try(lambda: self.lib.nvmlDeviceGetHandleByIndex(index))
            pci = _try(lambda: self.lib.nvmlDeviceGetPciInfo(handle)) if handle is not None else None
            bus_id = _text(getattr(pci, "busId", None)) if pci is not None else None
            address = normalize_bdf(bus_id or "")
            if address:
                self.handles[address] = handle

    def _inited(self) -> bool:
        # nvmlInit returns None on success, so "no exception" is the signal
        try:
            self.lib.nvmlInit()
            return True
        except Exception:
            return False

    def read(self) -> dict[str, VendorReading]:
        lib, out = self.lib, {}
        for address, h in self.handles.items():
            memory = _try(lambda: lib.nvmlDeviceGetMemoryInfo(h))
            power_mw = _try(lambda: lib.nvmlDeviceGetPowerUsage(h))
            util = _try(lambda: lib.nvmlDeviceGetUtilizationRates(h))
            sensor = getattr(lib, "NVML_TEMPERATURE_GPU", 0)
            out[address] = VendorReading(
                source="nvml",
                name=_text(_try(lambda: lib.nvmlDeviceGetName(h))),
                vram_bytes=getattr(memory, "total", None),
                vram_used_bytes=getattr(memory, "used", None),
                temperature_c=_try(lambda: lib.nvmlDeviceGetTemperature(h, sensor)),
                power_w=power_mw / 1000.0 if isinstance(power_mw, (int, float)) else None,
                load_pct=getattr(util, "gpu", None),
                link={
                    "current_gen": _try(lambda: lib.nvmlDeviceGetCurrPcieLinkGeneration(h)),
                    "current_width": _try(lambda: lib.nvmlDeviceGetCurrPcieLinkWidth(h)),
                    "max_gen": _try(lambda: lib.nvmlDeviceGetMaxPcieLinkGeneration(h)),
                    "max_width": _try(lambda: lib.nvmlDeviceGetMaxPcieLinkWidth(h)),
                },
            )
        return out

    def p2p(self, a: str, b: str) -> bool | None:
        """Whether NVML reports peer reads between two GPUs (None: cannot tell)."""
        lib = self.lib
        if a not in self.handles or b not in self.handles:
            return None
        index = getattr(lib, "NVML_P2P_CAPS_INDEX_READ", 0)
        status = _try(lambda: lib.nvmlDeviceGetP2PStatus(self.handles[a], self.handles[b], index))
        if status is None:
            return None
        return status == getattr(lib, "NVML_P2P_STATUS_OK", 0)

    def close(self) -> None:
        if self.ok:
            _try(self.lib.nvmlShutdown)
            self.ok = False
