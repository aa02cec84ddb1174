"""The PCIe tree from sysfs: each device, its upstream port, and the links on the way to the CPU.

sysfs nests a device's directory under its upstream bridge (/sys/devices/pci0000:00/0000:00:01.1/
0000:01:00.0/...), so the parent directory *is* the upstream port. Each hop's negotiated link is
what the downstream device reports; its best possible link is the lesser of both ends' maxima.

Why walk every hop: a Radeon 7900 card has its own PCIe switch, and the GPU behind it always
reports 16 GT/s x16, whatever slot the card sits in. Only the hop at the slot tells the truth, so
the effective link is the slowest and the narrowest over the whole path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from homelab_llm.hwcheck.sysfs import BDF_RE, is_dir, list_dir, read_int, read_text

HOST_BRIDGE_RE = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
MAX_DEPTH = 24  # real trees are < 10 deep; stops a pathological fixture or a loop
# GT/s -> PCIe generation, and usable GB/s per lane per direction (after line encoding)
GEN_BY_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

# Chipset switches: lanes behind these share one uplink to the CPU with USB, SATA and NVMe.
CHIPSET_SWITCH_IDS: dict[tuple[int, int], str] = {
    (0x1022, 0x43F4): "AMD 600/800-series chipset (Promontory 21) upstream port",
    (0x1022, 0x43F5): "AMD 600/800-series chipset (Promontory 21) downstream port",
    (0x1022, 0x43E9): "AMD 500-series chipset upstream port",
    (0x1022, 0x43EA): "AMD 500-series chipset downstream port",
    (0x1022, 0x43C6): "AMD 400-series chipset upstream port",
    (0x1022, 0x43C7): "AMD 400-series chipset downstream port",
    (0x1022, 0x57AD): "AMD X570/TRX40 chipset upstream port",
    (0x1022, 0x57A3): "AMD X570/TRX40 chipset downstream port",
    (0x1022, 0x57A4): "AMD X570/TRX40 chipset downstream port",
}
INTEL = 0x8086
AMD_HOST = 0x1022
# Intel platform root ports on bus 0: CPU PEG/CPU-M.2 ports are devices 0x01-0x07, the PCH's
# (chipset, behind the DMI link) are 0x1a-0x1d.
INTEL_CPU_ROOT_DEVICES = range(0x01, 0x08)
INTEL_PCH_ROOT_DEVICES = range(0x1A, 0x1E)


def parse_gen(speed: str | None) -> int | None:
    """'16.0 GT/s PCIe' / '8 GT/s' -> 4 / 3; 'Unknown' or garbage -> None."""
    if not speed:
        return None
    match = re.match(r"\s*([0-9.]+)\s*GT/s", speed)
    if not match:
        return None
    try:
        return GEN_BY_GTS.get(float(match.group(1)))
    except ValueError:
        return None


def parse_width(text: str | None) -> int | None:
    if not text:
        return None
    token = text.split()[0].lstrip("x")
    return int(token) if token.isdigit() and 0 < int(token) <= 32 else None


@dataclass(frozen=True)
class PciDevice:
    address: str
    parent: str | None  # upstream bridge; None for devices on the host bridge (root ports, iGPUs)
    host_bridge: str  # "pci0000:00": one root complex
    path: Path
    vendor_id: int | None
    device_id: int | None
    revision: int | None
    class_code: int | None
    current_gen: int | None
    current_width: int | None
    max_gen: int | None
    max_width: int | None
    numa_node: int | None

    @property
    def bus(self) -> int:
        return int(self.address.split(":")[1], 16)

    @property
    def device_number(self) -> int:
        return int(self.address.split(":")[2].split(".")[0], 16)


@dataclass(frozen=True)
class Hop:
    """One link: `downstream` to its upstream port."""

    downstream: str
    upstream: str
    current_gen: int | None
    current_width: int | None
    max_gen: int | None
    max_width: int | None

    @property
    def below_max(self) -> bool:
        return _lt(self.current_gen, self.max_gen) or _lt(self.current_width, self.max_width)


@dataclass(frozen=True)
class LinkInfo:
    current_gen: int | None
    current_width: int | None
    max_gen: int | None
    max_width: int | None
    bottleneck: str | None  # downstream address of the slowest hop
    gbps: float | None  # usable GB/s per direction at the current link

    def to_json(self) -> dict[str, object]:
        return {"current_gen": self.current_gen, "current_width": self.current_width,
                "max_gen": self.max_gen, "max_width": self.max_width,
                "bottleneck": self.bottleneck, "gbps": self.gbps}


def _lt(a: int | None, b: int | None) -> bool:
    return a is not None and b is not None and a < b


def _min(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def bandwidth_gbps(gen: int | None, width: int | None) -> float | None:
    if gen is None or width is None or gen not in GBPS_PER_LANE:
        return None
    return round(GBPS_PER_LANE[gen] * width, 1)


def _read_device(path: Path, parent: str | None, host_bridge: str) -> PciDevice:
    numa = read_int(path / "numa_node")
    return PciDevice(
        address=path.name, parent=parent, host_bridge=host_bridge, path=path,
        vendor_id=read_int(path / "vendor", 16), device_id=read_int(path / "device", 16),
        revision=read_int(path / "revision", 16), class_code=read_int(path / "class", 16),
        current_gen=parse_gen(read_text(path / "current_link_speed")),
        current_width=parse_width(read_text(path / "current_link_width")),
        max_gen=parse_gen(read_text(path / "max_link_speed")),
        max_width=parse_width(read_text(path / "max_link_width")),
        numa_node=numa if numa is not None and numa >= 0 else None,  # -1: no NUMA information
    )


class PciTree:
    """Every PCI device under <root>/sys/devices, keyed by address."""

    def __init__(self, devices: dict[str, PciDevice]) -> None:
        self.devices = devices

    @classmethod
    def scan(cls, sysfs_root: str | Path = "/") -> "PciTree":
        base = Path(sysfs_root) / "sys" / "devices"
        devices: dict[str, PciDevice] = {}
        for name in list_dir(base):
            if HOST_BRIDGE_RE.match(name):
                cls._walk(base / name, None, name, devices, 0)
        return cls(devices)

    @staticmethod
    def _walk(directory: Path, parent: str | None, host: str,
              out: dict[str, PciDevice], depth: int) -> None:
        if depth > MAX_DEPTH:
            return
        for name in list_dir(directory):
            child = directory / name
            if not BDF_RE.match(name) or name in out or child.is_symlink() or not is_dir(child):
                continue
            out[name] = _read_device(child, parent, host)
            PciTree._walk(child, name, host, out, depth + 1)

    def ancestors(self, address: str) -> list[PciDevice]:
        """Upstream ports from the device's parent up to the root port (nearest first)."""
        chain: list[PciDevice] = []
        current = self.devices.get(address)
        while current is not None and current.parent is not None and len(chain) <= MAX_DEPTH:
            current = self.devices.get(current.parent)
            if current is not None:
                chain.append(current)
        return chain

    def hops(self, address: str) -> list[Hop]:
        """Links from the device up to its root port, device end first."""
        out: list[Hop] = []
        node = self.devices.get(address)
        for upstream in self.ancestors(address):
            assert node is not None
            out.append(Hop(
                downstream=node.address, upstream=upstream.address,
                current_gen=node.current_gen if node.current_gen is not None else upstream.current_gen,
                current_width=node.current_width if node.current_width is not None
                else upstream.current_width,
                max_gen=_min([node.max_gen, upstream.max_gen]),
                max_width=_min([node.max_width, upstream.max_width]),
            ))
            node = upstream
        return out

    def effective_link(self, address: str) -> LinkInfo:
        hops = self.hops(address)
        if not hops:  # on the host bridge itself (iGPU): report what the device says, if anything
            d = self.devices.get(address)
            if d is None:
                return LinkInfo(None, None, None, None, None, None)
            return LinkInfo(d.current_gen, d.current_width, d.max_gen, d.max_width, None,
                            bandwidth_gbps(d.current_gen, d.current_width))
        gen = _min([h.current_gen for h in hops])
        width = _min([h.current_width for h in hops])
        rated = [(bandwidth_gbps(h.current_gen, h.current_width), h.downstream) for h in hops]
        rated_known = [r for r in rated if r[0] is not None]
        bottleneck = min(rated_known)[1] if rated_known else None
        return LinkInfo(gen, width, _min([h.max_gen for h in hops]),
                        _min([h.max_width for h in hops]), bottleneck, bandwidth_gbps(gen, width))

    def attached_to(self, address: str) -> str:
        """'cpu', 'chipset' or 'unknown': whose lanes the device hangs off."""
        chain = self.ancestors(address)
        for d in chain:
            if (d.vendor_id, d.device_id) in CHIPSET_SWITCH_IDS:
                return "chipset"
        if not chain:
            # On the host bridge itself: an Intel iGPU (00:02.0) is on the CPU die; anything else
            # there is a virtual machine's passthrough device, whose real slot we cannot see.
            device = self.devices.get(address)
            return "cpu" if device is not None and device.vendor_id == INTEL else "unknown"
        root = chain[-1]
        if root.vendor_id == INTEL and root.bus == 0:
            if root.device_number in INTEL_PCH_ROOT_DEVICES:
                return "chipset"
            if root.device_number in INTEL_CPU_ROOT_DEVICES:
                return "cpu"
            return "unknown"
        if root.vendor_id == AMD_HOST:
            return "cpu"  # AMD root ports all live in the CPU's I/O die
        return "unknown"

    def chipset_switch(self, address: str) -> str | None:
        for d in self.ancestors(address):
            label = CHIPSET_SWITCH_IDS.get((d.vendor_id or 0, d.device_id or 0))
            if label:
                return label
        return None

    def root_port(self, address: str) -> str | None:
        chain = self.ancestors(address)
        return chain[-1].address if chain else None
