"""`hwcheck` results: GPUs, the topology matrix and warnings, as JSON and as a text report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from homelab_llm.hwcheck.backends import AUTO, NvmlSession
from homelab_llm.hwcheck.gpus import GpuInfo, detect_gpus, is_display
from homelab_llm.hwcheck.p2p import Topology, build_topology
from homelab_llm.hwcheck.pcie import Hop, PciTree, bandwidth_gbps
from homelab_llm.hwcheck.topology_text import Matrix, TreeGpu, render_matrix, render_tree


@dataclass(frozen=True)
class HwWarning:
    level: str  # "warn" | "info"
    message: str
    pci_address: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"level": self.level, "pci_address": self.pci_address, "message": self.message}


@dataclass
class HwReport:
    gpus: list[GpuInfo]
    topology: Topology
    warnings: list[HwWarning] = field(default_factory=list)
    paths: dict[str, list[Hop]] = field(default_factory=dict)  # GPU address -> hops, GPU end first

    def to_json(self) -> dict[str, Any]:
        return {"gpus": [{**g.to_json(), "path": self.path_json(g.pci_address)} for g in self.gpus],
                "topology": self.topology.to_json(),
                "warnings": [w.to_json() for w in self.warnings]}

    def path_json(self, address: str) -> list[dict[str, Any]]:
        return [asdict(hop) for hop in self.paths.get(address, [])]


def _link_text(gen: int | None, width: int | None) -> str:
    return f"Gen{gen or '?'} x{width or '?'}"


def link_warnings(tree: PciTree, gpu: GpuInfo) -> list[HwWarning]:
    out: list[HwWarning] = []
    addr = gpu.pci_address
    if not tree.hops(addr):
        out.append(HwWarning("info", f"{gpu.name} at {addr} sits on the host bridge with no "
                             "upstream port (a virtual machine's passthrough GPU?): its link and "
                             "lanes are as the guest sees them, not the physical slot", addr))
    for hop in tree.hops(addr):
        if hop.current_width is not None and hop.max_width is not None \
                and hop.current_width < hop.max_width:
            out.append(HwWarning("warn", f"{gpu.name} at {addr}: link {hop.upstream} -> "
                                 f"{hop.downstream} trained x{hop.current_width} of x{hop.max_width} "
                                 "possible (reseat the card; check lane sharing with M.2 slots)", addr))
        if hop.current_gen is not None and hop.max_gen is not None and hop.current_gen < hop.max_gen:
            out.append(HwWarning("warn", f"{gpu.name} at {addr}: link {hop.upstream} -> "
                                 f"{hop.downstream} runs Gen{hop.current_gen} of Gen{hop.max_gen} "
                                 "possible (GPUs slow their link when idle: re-check under load; "
                                 "if it stays low, check the BIOS slot speed and any riser)", addr))
    # Judge the speed by what the path can train at (an idle link reads Gen1, warned above) and
    # the width by what it did train at (width does not drop at idle).
    link = gpu.link
    gen = link.max_gen if link.max_gen is not None else link.current_gen
    if (gen is not None and gen <= 3) or (link.current_width is not None and link.current_width <= 4):
        gbps = bandwidth_gbps(gen, link.current_width)
        out.append(HwWarning("warn", f"{gpu.name} at {addr}: the path to the CPU is "
                             f"{_link_text(gen, link.current_width)} at best"
                             + (f" (~{gbps} GB/s each way)" if gbps else "")
                             + "; tensor-parallel all-reduce and model loading will be slow", addr))
    return out


def system_warnings(gpus: list[GpuInfo]) -> list[HwWarning]:
    out: list[HwWarning] = []
    discrete = [g for g in gpus if not g.integrated]
    if not discrete:
        out.append(HwWarning("info", "no discrete GPU found; the engine will run on the CPU"))
    if len(discrete) >= 2:
        for g in discrete:
            if g.attached_to == "chipset":
                out.append(HwWarning("warn", f"{g.name} at {g.pci_address} is on chipset lanes "
                                     f"({g.chipset_switch or 'PCH root port'}): its tensor-parallel "
                                     "partner's all-reduce shares the chipset uplink with USB, SATA "
                                     "and NVMe; use a CPU slot, a riser from one, or split by layers",
                                     g.pci_address))
        nodes = {g.numa_node for g in discrete if g.numa_node is not None}
        if len(nodes) > 1:
            out.append(HwWarning("warn", f"GPUs sit on NUMA nodes {sorted(nodes)}: traffic between "
                                 "them crosses the CPU interconnect; pin the server to one node"))
    for g in discrete:
        if g.vendor == "amd" and g.bar_bytes is not None and g.vram_bytes \
                and g.bar_bytes < g.vram_bytes:
            out.append(HwWarning("warn", f"{g.name} at {g.pci_address}: BAR {g.bar_bytes >> 20} MiB is "
                                 "smaller than VRAM: enable Above 4G Decoding and Resizable BAR in the "
                                 "BIOS (needed for GPU peer-to-peer)", g.pci_address))
    return out


def p2p_warnings(gpus: list[GpuInfo], topology: Topology) -> list[HwWarning]:
    out: list[HwWarning] = []
    for i, a in enumerate(gpus):
        for j in range(i + 1, len(gpus)):
            b = gpus[j]
            if a.integrated or b.integrated or topology.p2p[i][j] != "NS":
                continue
            out.append(HwWarning("info", f"no P2P between {a.pci_address} and {b.pci_address}: "
                                 "all-reduce is staged through host memory (slower, still works)"))
    return out


def make_report(sysfs_root: str | Path = "/", *, amd: Any = AUTO, nvml: Any = AUTO) -> HwReport:
    tree = PciTree.scan(sysfs_root)
    has_nvidia = any(d.vendor_id == 0x10DE and is_display(d) for d in tree.devices.values())
    # NVML only when there is an NVIDIA GPU: its init costs time and logs on other machines
    session = NvmlSession(nvml) if nvml is not None and has_nvidia else None
    try:
        gpus = detect_gpus(sysfs_root, amd=amd, nvml=nvml, tree=tree, nvml_session=session)
        # the matrix is about tensor-parallel partners: discrete GPUs only (they sort first)
        topology = build_topology(sysfs_root, tree, [g for g in gpus if not g.integrated], session)
    finally:
        if session is not None:
            session.close()
    warnings = [w for g in gpus if not g.integrated for w in link_warnings(tree, g)]
    warnings += system_warnings(gpus) + p2p_warnings([g for g in gpus if not g.integrated], topology)
    return HwReport(gpus, topology, warnings, {g.pci_address: tree.hops(g.pci_address) for g in gpus})


def _gib(n: int | None) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n else "?"


def render_text(report: HwReport) -> str:
    lines: list[str] = []
    if not report.gpus:
        lines.append("No GPUs found in sysfs.")
    for i, g in enumerate(report.gpus):
        link = g.link
        label = "iGPU" if g.integrated else f"GPU{i}"
        kind = "integrated" if g.integrated else g.attached_to + " lanes"
        lines.append(f"{label:<5} {g.pci_address}  {g.name}  [{kind}]")
        used = f"{_gib(g.vram_used_bytes)} used of " if g.vram_used_bytes is not None else ""
        link_text = "n/a" if link.current_width is None and link.current_gen is None else (
            f"{_link_text(link.current_gen, link.current_width)} "
            f"(max {_link_text(link.max_gen, link.max_width)})"
            + (f" ~{link.gbps} GB/s" if link.gbps else ""))
        lines.append(f"      VRAM {used}{_gib(g.vram_bytes)}   link {link_text}"
                     f"   NUMA {g.numa_node if g.numa_node is not None else '-'}")
        live = [f"{g.temperature_c:.0f} C" if g.temperature_c is not None else None,
                f"{g.power_w:.0f} W" if g.power_w is not None else None,
                f"{g.load_pct:.0f}% busy" if g.load_pct is not None else None]
        if any(live):
            lines.append("      " + "  ".join(x for x in live if x))
    if len(report.topology.gpus) > 1:
        lines += ["", render_matrix(Matrix.from_json(report.topology.to_json()))]
    discrete = [(i, g) for i, g in enumerate(report.gpus) if not g.integrated]
    if discrete:
        lines += ["", render_tree([TreeGpu(f"GPU{i} {g.name}", g.pci_address, g.attached_to,
                                           tuple(report.path_json(g.pci_address)))
                                   for i, g in discrete])]
    if report.warnings:
        lines.append("")
        lines += [f"{w.level}: {w.message}" for w in report.warnings]
    return "\n".join(lines)
