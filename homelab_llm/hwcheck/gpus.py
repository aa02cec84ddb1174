"""GPUs: found in the PCI tree (display class), described from sysfs, enriched by vendor libraries.

sysfs is the floor: it needs no library and no permissions beyond reading /sys, so it always gives
the PCI address, vendor, link and NUMA node. amdgpu also exposes VRAM, load, temperature and power
there; pyamdgpuinfo and NVML add or refine what they can.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from homelab_llm.hwcheck.backends import AUTO, NvmlSession, VendorReading, read_amd
from homelab_llm.hwcheck.pcie import LinkInfo, PciDevice, PciTree, bandwidth_gbps
from homelab_llm.hwcheck.sysfs import list_dir, read_int, read_keyvals, read_text

VENDORS = {0x1002: "amd", 0x10DE: "nvidia", 0x8086: "intel"}
DISPLAY_CLASS = 0x03  # PCI base class "display controller" (VGA, 3D, other)

# (vendor, device, revision or None) -> marketing name, for when no library names the card.
KNOWN_NAMES: dict[tuple[int, int, int | None], str] = {
    (0x1002, 0x744C, 0xC8): "Radeon RX 7900 XTX",
    (0x1002, 0x744C, 0xCC): "Radeon RX 7900 XT",
    (0x1002, 0x744C, 0xCE): "Radeon RX 7900 GRE",
    (0x1002, 0x744C, None): "Radeon RX 7900 series",
    (0x1002, 0x7448, None): "Radeon PRO W7900",
    (0x1002, 0x747E, None): "Radeon RX 7800 XT / 7700 XT",
    (0x1002, 0x7550, None): "Radeon RX 9070 series",
    (0x10DE, 0x2204, None): "GeForce RTX 3090",
    (0x10DE, 0x2203, None): "GeForce RTX 3090 Ti",
    (0x10DE, 0x2684, None): "GeForce RTX 4090",
    (0x10DE, 0x2704, None): "GeForce RTX 4080",
    (0x10DE, 0x2B85, None): "GeForce RTX 5090",
    (0x10DE, 0x2C02, None): "GeForce RTX 5080",
    (0x10DE, 0x2335, None): "H200",
    (0x1002, 0x164E, None): "AMD Radeon Graphics (Ryzen 7000 iGPU)",
    (0x1002, 0x15BF, None): "AMD Radeon 780M (Ryzen 7040 iGPU)",
    (0x8086, 0xA780, None): "Intel UHD Graphics 770",
}
# AMD APU graphics (Renoir .. Strix): on the CPU package, sharing system RAM.
AMD_IGPU_IDS = {0x1636, 0x1638, 0x164C, 0x164E, 0x1681, 0x15BF, 0x15C8, 0x1900, 0x150E, 0x13C0}
# Intel discrete parts (Arc Alchemist 0x56xx, Battlemage 0xE2xx); every other Intel GPU is integrated.
INTEL_DISCRETE_PREFIXES = (0x56, 0xE2)


@dataclass
class GpuInfo:
    pci_address: str
    vendor: str  # amd | nvidia | intel | other
    vendor_id: int | None
    device_id: int | None
    name: str
    integrated: bool
    vram_bytes: int | None
    link: LinkInfo
    attached_to: str  # cpu | chipset | unknown
    numa_node: int | None
    vram_used_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    load_pct: float | None = None
    driver: str | None = None
    bar_bytes: int | None = None  # largest memory BAR: >= VRAM means Resizable BAR is on
    local_cpulist: str | None = None
    root_port: str | None = None
    chipset_switch: str | None = None
    sources: list[str] = field(default_factory=lambda: ["sysfs"])

    def to_json(self) -> dict[str, Any]:
        return {
            "pci_address": self.pci_address, "vendor": self.vendor, "name": self.name,
            "integrated": self.integrated, "vram_bytes": self.vram_bytes,
            "link": self.link.to_json(), "attached_to": self.attached_to,
            "numa_node": self.numa_node, "vram_used_bytes": self.vram_used_bytes,
            "temperature_c": self.temperature_c, "power_w": self.power_w,
            "load_pct": self.load_pct, "driver": self.driver, "bar_bytes": self.bar_bytes,
            "root_port": self.root_port, "chipset_switch": self.chipset_switch,
            "sources": self.sources,
        }


def is_display(device: PciDevice) -> bool:
    return device.class_code is not None and device.class_code >> 16 == DISPLAY_CLASS


def _name(d: PciDevice, sysfs_name: str | None) -> str:
    if sysfs_name:
        return sysfs_name
    for key in ((d.vendor_id, d.device_id, d.revision), (d.vendor_id, d.device_id, None)):
        if key in KNOWN_NAMES:
            return KNOWN_NAMES[key]  # type: ignore[index]
    vendor = VENDORS.get(d.vendor_id or 0, "unknown vendor")
    return f"{vendor} GPU {d.vendor_id or 0:04x}:{d.device_id or 0:04x}"


def _largest_bar(path: Path) -> int | None:
    """From `resource`: one 'start end flags' hex line per BAR; the largest memory window."""
    sizes = []
    for line in (read_text(path / "resource") or "").splitlines()[:6]:
        parts = line.split()
        try:
            start, end = int(parts[0], 16), int(parts[1], 16)
        except (IndexError, ValueError):
            continue
        if end > start:
            sizes.append(end - start + 1)
    return max(sizes) if sizes else None


def _hwmon(path: Path) -> tuple[float | None, float | None]:
    """(temperature °C, power W) from the first hwmon under the device."""
    for name in list_dir(path / "hwmon"):
        mon = path / "hwmon" / name
        temp = read_int(mon / "temp1_input")  # millidegrees
        power = read_int(mon / "power1_average")
        if power is None:
            power = read_int(mon / "power1_input")  # newer amdgpu: microwatts, instantaneous
        return (temp / 1000.0 if temp is not None else None,
                power / 1e6 if power is not None else None)
    return None, None


def _integrated(d: PciDevice, vendor: str, vram: int | None) -> bool:
    if vendor == "intel":
        return (d.device_id or 0) >> 8 not in INTEL_DISCRETE_PREFIXES
    if vendor == "amd":
        # APUs report a small BIOS carve-out as "VRAM"; no discrete AMD card has <= 1 GiB
        return d.device_id in AMD_IGPU_IDS or (vram is not None and vram <= 1 << 30)
    return False


def from_sysfs(tree: PciTree, d: PciDevice) -> GpuInfo:
    vendor = VENDORS.get(d.vendor_id or 0, "other")
    vram = read_int(d.path / "mem_info_vram_total")  # amdgpu only
    temp, power = _hwmon(d.path)
    busy = read_int(d.path / "gpu_busy_percent")
    return GpuInfo(
        pci_address=d.address, vendor=vendor, vendor_id=d.vendor_id, device_id=d.device_id,
        name=_name(d, read_text(d.path / "product_name")),
        integrated=_integrated(d, vendor, vram), vram_bytes=vram,
        link=tree.effective_link(d.address), attached_to=tree.attached_to(d.address),
        numa_node=d.numa_node, vram_used_bytes=read_int(d.path / "mem_info_vram_used"),
        temperature_c=temp, power_w=power,
        load_pct=float(busy) if busy is not None and 0 <= busy <= 100 else None,
        driver=read_keyvals(d.path / "uevent").get("DRIVER"),
        bar_bytes=_largest_bar(d.path), local_cpulist=read_text(d.path / "local_cpulist"),
        root_port=tree.root_port(d.address), chipset_switch=tree.chipset_switch(d.address),
    )


def merge(gpu: GpuInfo, reading: VendorReading) -> None:
    """A library's values win over sysfs where it gives one. The link stays the sysfs path's
    (NVML only sees the GPU's own hop and its own maximum, not the slot's); NVML fills it in only
    where sysfs shows no link at all (containers with a partial /sys)."""
    gpu.sources.append(reading.source)
    if reading.name:
        gpu.name = reading.name
    for attr in ("vram_bytes", "vram_used_bytes", "temperature_c", "power_w", "load_pct"):
        value = getattr(reading, attr)
        if isinstance(value, (int, float)) and value >= 0:
            setattr(gpu, attr, value)
    link = reading.link
    if link and all(isinstance(link.get(k), int) for k in link) and gpu.link.current_width is None:
        gen, width = link["current_gen"], link["current_width"]
        gpu.link = LinkInfo(gen, width, link["max_gen"], link["max_width"], gpu.link.bottleneck,
                            bandwidth_gbps(gen, width))


def detect_gpus(sysfs_root: str | Path = "/", *, amd: Any = AUTO, nvml: Any = AUTO,
                tree: PciTree | None = None, nvml_session: NvmlSession | None = None,
                ) -> list[GpuInfo]:
    """Every display-class PCI device, discrete first, then by address.

    Pass `amd=None` / `nvml=None` to skip a library, or a fake module in tests. A caller that wants
    P2P from NVML afterwards passes its own `nvml_session` (and closes it).
    """
    tree = tree or PciTree.scan(sysfs_root)
    gpus = [from_sysfs(tree, d) for d in tree.devices.values() if is_display(d)]
    readings: dict[str, VendorReading] = {}
    if any(g.vendor == "amd" for g in gpus):
        readings.update(read_amd(amd))
    if any(g.vendor == "nvidia" for g in gpus):
        session = nvml_session or NvmlSession(nvml)
        try:
            readings.update(session.read())
        finally:
            if nvml_session is None:
                session.close()
    for gpu in gpus:
        if gpu.pci_address in readings:
            merge(gpu, readings[gpu.pci_address])
    return sorted(gpus, key=lambda g: (g.integrated, g.pci_address))
