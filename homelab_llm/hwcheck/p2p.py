"""Between GPU pairs: how traffic travels (an `nvidia-smi topo -m` style matrix) and whether the
GPUs can read each other's memory directly (P2P).

Connection labels, as nvidia-smi uses them:
  X     the GPU itself
  PIX   through at most one PCIe bridge (two GPUs behind one switch port)
  PXB   through several PCIe bridges, without the host bridge
  PHB   through the PCIe host bridge (the CPU's root complex): two CPU slots, or CPU + chipset
  NODE  between host bridges of one NUMA node
  SYS   across NUMA nodes (socket or die interconnect)

P2P sources: NVML's P2P read status for NVIDIA (GeForce 4090/5090 report "not supported" on the
stock driver); the amdkfd topology for AMD, whose `p2p_links` list the peers the kernel set up
(it needs Resizable BAR so a peer can map all of VRAM). Anything else is "unknown", never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from homelab_llm.hwcheck.backends import NvmlSession
from homelab_llm.hwcheck.gpus import GpuInfo
from homelab_llm.hwcheck.pcie import PciTree
from homelab_llm.hwcheck.sysfs import is_dir, list_dir, read_keyvals

KFD_NODES = Path("sys/class/kfd/kfd/topology/nodes")
KFD_LINK_XGMI = 11  # io_link type for Infinity Fabric links (MI-series; none on Radeon cards)


@dataclass(frozen=True)
class Topology:
    gpus: list[str]  # PCI addresses, in matrix order
    connection: list[list[str]]  # [i][j] label as above
    p2p: list[list[str]]  # [i][j] "OK" | "NS" (not supported) | "?" (unknown) | "X"
    numa: list[int | None]
    cpus: list[str | None]

    def to_json(self) -> dict[str, object]:
        return {"gpus": self.gpus, "connection": self.connection, "p2p": self.p2p,
                "numa_affinity": self.numa, "cpu_affinity": self.cpus}


def connection(tree: PciTree, a: GpuInfo, b: GpuInfo) -> str:
    if a.pci_address == b.pci_address:
        return "X"
    up_a = [d.address for d in tree.ancestors(a.pci_address)]
    up_b = [d.address for d in tree.ancestors(b.pci_address)]
    shared = [addr for addr in up_a if addr in up_b]
    if shared:
        nearest = shared[0]
        # bridges crossed: the ones below the common one on both sides, plus the common one
        crossed = up_a.index(nearest) + up_b.index(nearest) + 1
        return "PIX" if crossed <= 1 else "PXB"
    host_a = tree.devices[a.pci_address].host_bridge if a.pci_address in tree.devices else None
    host_b = tree.devices[b.pci_address].host_bridge if b.pci_address in tree.devices else None
    if host_a is not None and host_a == host_b:
        return "PHB"
    if a.numa_node is not None and b.numa_node is not None and a.numa_node != b.numa_node:
        return "SYS"
    return "NODE"


def _kfd_peers(sysfs_root: Path) -> tuple[dict[str, set[str]], bool]:
    """({gpu address: peer addresses over P2P/XGMI}, whether the kernel reports p2p_links at all)."""
    base = sysfs_root / KFD_NODES
    by_node: dict[str, str] = {}
    links: dict[str, list[tuple[str, int | None]]] = {}
    has_p2p_dirs = False
    for node in list_dir(base):
        props = read_keyvals(base / node / "properties", sep=" ")
        try:
            location, domain = int(props["location_id"]), int(props.get("domain", "0"))
        except (KeyError, ValueError):
            continue
        if location == 0 and props.get("simd_count", "0") == "0":
            continue  # CPU node
        bus, devfn = location >> 8, location & 0xFF
        by_node[node] = f"{domain:04x}:{bus:02x}:{devfn >> 3:02x}.{devfn & 7}"
        for kind in ("p2p_links", "io_links"):
            has_p2p_dirs |= kind == "p2p_links" and is_dir(base / node / kind)
            for link in list_dir(base / node / kind):
                lp = read_keyvals(base / node / kind / link / "properties", sep=" ")
                try:
                    link_type = int(lp.get("type", "-1"))
                except ValueError:
                    link_type = None
                if kind == "p2p_links" or link_type == KFD_LINK_XGMI:
                    links.setdefault(node, []).append((lp.get("node_to", ""), link_type))
    peers: dict[str, set[str]] = {}
    for node, targets in links.items():
        for target, _ in targets:
            if node in by_node and target in by_node:
                peers.setdefault(by_node[node], set()).add(by_node[target])
    return peers, has_p2p_dirs


def p2p_status(sysfs_root: Path, a: GpuInfo, b: GpuInfo, nvml: NvmlSession | None,
               kfd: tuple[dict[str, set[str]], bool] | None = None) -> str:
    if a.pci_address == b.pci_address:
        return "X"
    if a.vendor != b.vendor or a.integrated or b.integrated:
        return "NS"
    if a.vendor == "nvidia" and nvml is not None:
        ok = nvml.p2p(a.pci_address, b.pci_address)
        return "?" if ok is None else ("OK" if ok else "NS")
    if a.vendor == "amd":
        peers, reported = kfd if kfd is not None else _kfd_peers(sysfs_root)
        if b.pci_address in peers.get(a.pci_address, set()):
            return "OK"
        return "NS" if reported else "?"
    return "?"


def build_topology(sysfs_root: str | Path, tree: PciTree, gpus: list[GpuInfo],
                   nvml: NvmlSession | None = None) -> Topology:
    root = Path(sysfs_root)
    kfd = _kfd_peers(root) if any(g.vendor == "amd" for g in gpus) else ({}, False)
    return Topology(
        gpus=[g.pci_address for g in gpus],
        connection=[[connection(tree, a, b) for b in gpus] for a in gpus],
        p2p=[[p2p_status(root, a, b, nvml, kfd) for b in gpus] for a in gpus],
        numa=[g.numa_node for g in gpus],
        cpus=[g.local_cpulist for g in gpus],
    )
