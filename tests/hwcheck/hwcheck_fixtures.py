"""Builds the fixture sysfs trees in tests/hwcheck/fixtures from real topologies.

Run `python tests/hwcheck/hwcheck_fixtures.py` to regenerate them; a test checks the committed
trees still match. Device IDs, link speeds and the Radeon on-card switch are as `lspci -tv` and
sysfs show them on these platforms (Navi 31 upstream/downstream switch ports 1002:1478/1479, AMD
600-series chipset switch 1022:43f4/43f5, Intel 700-series PCH root ports on device 0x1c).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
SPEED = {1: "2.5 GT/s PCIe", 2: "5.0 GT/s PCIe", 3: "8.0 GT/s PCIe", 4: "16.0 GT/s PCIe",
         5: "32.0 GT/s PCIe"}
BRIDGE, VGA, AUDIO, NVME = 0x060400, 0x030000, 0x040300, 0x010802
GIB = 1 << 30
XTX_VRAM = 25_753_026_560  # what amdgpu reports for a 24 GB 7900 XTX


class Tree:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.kfd_nodes: list[tuple[str, list[str]] | None] = []

    def dev(self, chain: list[str], vendor: int, device: int, cls: int, *, cur: tuple[int, int]
            | None = None, max_: tuple[int, int] | None = None, rev: int = 0, numa: int = -1,
            driver: str | None = None, files: dict[str, str] | None = None) -> Path:
        """`chain`: host bridge then addresses down to this device, e.g. ['pci0000:00', '0000:00:01.1']."""
        path = self.root / "sys" / "devices" / Path(*chain)
        path.mkdir(parents=True, exist_ok=True)
        attrs = {"vendor": f"0x{vendor:04x}", "device": f"0x{device:04x}", "class": f"0x{cls:06x}",
                 "revision": f"0x{rev:02x}", "numa_node": str(numa),
                 "uevent": (f"DRIVER={driver}\n" if driver else "")
                 + f"PCI_ID={vendor:04X}:{device:04X}\nPCI_SLOT_NAME={chain[-1]}"}
        if cur:
            attrs |= {"current_link_speed": SPEED[cur[0]], "current_link_width": str(cur[1])}
        if max_:
            attrs |= {"max_link_speed": SPEED[max_[0]], "max_link_width": str(max_[1])}
        attrs |= files or {}
        for name, text in attrs.items():
            target = path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text + "\n")
        return path

    def radeon_7900xtx(self, above: list[str], bus: int, *, slot: tuple[int, int],
                       card_max: tuple[int, int] = (4, 16), slot_cur: tuple[int, int] | None = None,
                       bar: int = 32 * GIB, numa: int = -1) -> str:
        """The card's own switch (upstream 1478, downstream 1479) then the GPU and its audio.
        `slot`: what the slot's link trained at (seen on the upstream switch port only)."""
        up = [*above, f"0000:{bus:02x}:00.0"]
        self.dev(up, 0x1002, 0x1478, BRIDGE, cur=slot_cur or slot, max_=card_max, numa=numa,
                 driver="pcieport")
        down = [*up, f"0000:{bus + 1:02x}:00.0"]
        self.dev(down, 0x1002, 0x1479, BRIDGE, cur=(4, 16), max_=(4, 16), numa=numa,
                 driver="pcieport")
        gpu = [*down, f"0000:{bus + 2:02x}:00.0"]
        self.dev(gpu, 0x1002, 0x744C, VGA, rev=0xC8, cur=(4, 16), max_=(4, 16), numa=numa,
                 driver="amdgpu", files={
                     "mem_info_vram_total": str(XTX_VRAM), "mem_info_vram_used": str(512 << 20),
                     "gpu_busy_percent": "3", "local_cpulist": "0-15",
                     "hwmon/hwmon3/temp1_input": "41000", "hwmon/hwmon3/power1_average": "23000000",
                     "resource": _resource(bar)})
        self.dev([*down, f"0000:{bus + 2:02x}:00.1"], 0x1002, 0xAB30, AUDIO, numa=numa)
        return gpu[-1]

    def kfd(self, gpus: list[str], p2p: list[tuple[int, int]] | None) -> None:
        """amdkfd topology: node 0 is the CPU, node i+1 the i-th GPU; `p2p` pairs of GPU indexes,
        or None for a kernel without p2p_links."""
        base = self.root / "sys/class/kfd/kfd/topology/nodes"
        (base / "0").mkdir(parents=True, exist_ok=True)
        (base / "0/properties").write_text("cpu_cores_count 16\nsimd_count 0\nlocation_id 0\n"
                                           "domain 0\n")
        for i, addr in enumerate(gpus, start=1):
            node = base / str(i)
            node.mkdir(parents=True, exist_ok=True)
            domain, bus, devfn = addr.split(":")
            dev, fn = devfn.split(".")
            location = int(bus, 16) << 8 | int(dev, 16) << 3 | int(fn)
            (node / "properties").write_text(f"cpu_cores_count 0\nsimd_count 192\n"
                                             f"location_id {location}\ndomain {int(domain, 16)}\n")
            io = node / "io_links/0"
            io.mkdir(parents=True, exist_ok=True)
            (io / "properties").write_text(f"type 2\nnode_from {i}\nnode_to 0\n")
            if p2p is not None:
                (node / "p2p_links").mkdir(exist_ok=True)
                # git keeps no empty folders; the reader skips dot entries as sysfs has none.
                (node / "p2p_links" / ".gitkeep").touch()
        for k, (a, b) in enumerate(p2p or []):
            for src, dst in ((a + 1, b + 1), (b + 1, a + 1)):
                link = base / str(src) / "p2p_links" / str(k)
                link.mkdir(parents=True, exist_ok=True)
                (link / "properties").write_text(f"type 2\nnode_from {src}\nnode_to {dst}\n")


def _resource(bar0: int) -> str:
    start = 0x7800000000
    lines = [f"0x{start:016x} 0x{start + bar0 - 1:016x} 0x000000000014220c",
             "0x0000000000000000 0x0000000000000000 0x0000000000000000",
             "0x00000000f6000000 0x00000000f61fffff 0x000000000014220c"]
    return "\n".join(lines)


def raphael_igpu(t: Tree) -> None:
    t.dev(["pci0000:00", "0000:00:08.1"], 0x1022, 0x14DD, BRIDGE, cur=(4, 16), max_=(4, 16))
    t.dev(["pci0000:00", "0000:00:08.1", "0000:10:00.0"], 0x1002, 0x164E, VGA, rev=0xC1,
          cur=(4, 16), max_=(4, 16), driver="amdgpu",
          files={"mem_info_vram_total": str(512 << 20), "resource": _resource(256 << 20)})


def am5_x16(root: Path) -> None:
    t = Tree(root)
    t.dev(["pci0000:00", "0000:00:01.1"], 0x1022, 0x14DB, BRIDGE, cur=(4, 16), max_=(5, 16))
    t.radeon_7900xtx(["pci0000:00", "0000:00:01.1"], 0x01, slot=(4, 16))
    raphael_igpu(t)


def am5_x8x8(root: Path) -> None:
    t = Tree(root)
    gpus = []
    for port, bus in (("0000:00:01.1", 0x01), ("0000:00:01.2", 0x04)):
        t.dev(["pci0000:00", port], 0x1022, 0x14DB, BRIDGE, cur=(4, 8), max_=(5, 8))
        gpus.append(t.radeon_7900xtx(["pci0000:00", port], bus, slot=(4, 8)))
    raphael_igpu(t)
    t.kfd(gpus, p2p=[(0, 1)])


def am5_chipset_x4(root: Path) -> None:
    """X670E: one card in the CPU x16 slot, the other in the bottom slot: chipset, x4 electrical,
    Resizable BAR off (256 MiB BAR), so the kernel sets up no P2P."""
    t = Tree(root)
    t.dev(["pci0000:00", "0000:00:01.1"], 0x1022, 0x14DB, BRIDGE, cur=(4, 16), max_=(5, 16))
    g0 = t.radeon_7900xtx(["pci0000:00", "0000:00:01.1"], 0x01, slot=(4, 16), bar=256 << 20)
    chipset = ["pci0000:00", "0000:00:02.1"]
    t.dev(chipset, 0x1022, 0x14DA, BRIDGE, cur=(4, 4), max_=(4, 4))
    t.dev([*chipset, "0000:04:00.0"], 0x1022, 0x43F4, BRIDGE, cur=(4, 4), max_=(4, 4))
    t.dev([*chipset, "0000:04:00.0", "0000:05:00.0"], 0x1022, 0x43F5, BRIDGE, cur=(4, 4),
          max_=(4, 4))
    t.dev([*chipset, "0000:04:00.0", "0000:05:00.0", "0000:06:00.0"], 0x1022, 0x43F4, BRIDGE,
          cur=(4, 4), max_=(4, 4))
    slot_port = [*chipset, "0000:04:00.0", "0000:05:00.0", "0000:06:00.0", "0000:07:08.0"]
    t.dev(slot_port, 0x1022, 0x43F5, BRIDGE, cur=(4, 4), max_=(4, 4))
    t.dev([*chipset, "0000:04:00.0", "0000:05:00.0", "0000:06:00.0", "0000:07:0c.0"],
          0x1022, 0x43F5, BRIDGE, cur=(4, 4), max_=(4, 4))
    g1 = t.radeon_7900xtx(slot_port, 0x0A, slot=(4, 4), bar=256 << 20)
    raphael_igpu(t)
    t.kfd([g0, g1], p2p=[])


def threadripper_x16x16(root: Path) -> None:
    t = Tree(root)
    gpus = []
    for host, port, bus in (("pci0000:00", "0000:00:01.1", 0x01), ("pci0000:40", "0000:40:01.1", 0x41)):
        t.dev([host, port], 0x1022, 0x1483, BRIDGE, cur=(4, 16), max_=(4, 16), numa=0)
        gpus.append(t.radeon_7900xtx([host, port], bus, slot=(4, 16), numa=0))
    t.kfd(gpus, p2p=[(0, 1)])


def nvidia_gpu(t: Tree, chain: list[str], device: int, cur: tuple[int, int],
               max_: tuple[int, int]) -> None:
    t.dev(chain, 0x10DE, device, VGA, rev=0xA1, cur=cur, max_=max_, driver="nvidia",
          files={"resource": _resource(32 * GIB), "local_cpulist": "0-23"})
    t.dev([*chain[:-1], chain[-1][:-1] + "1"], 0x10DE, 0x22BA, AUDIO)


def intel_z790_pch(root: Path) -> None:
    """Z790: RTX 4090 in the CPU PEG slot, RTX 3090 in the bottom slot on a PCH root port (x4)."""
    t = Tree(root)
    t.dev(["pci0000:00", "0000:00:01.0"], 0x8086, 0xA70D, BRIDGE, cur=(4, 16), max_=(5, 16))
    nvidia_gpu(t, ["pci0000:00", "0000:00:01.0", "0000:01:00.0"], 0x2684, (4, 16), (4, 16))
    t.dev(["pci0000:00", "0000:00:1c.4"], 0x8086, 0x7A3C, BRIDGE, cur=(4, 4), max_=(4, 4))
    nvidia_gpu(t, ["pci0000:00", "0000:00:1c.4", "0000:04:00.0"], 0x2204, (4, 4), (4, 16))
    t.dev(["pci0000:00", "0000:00:02.0"], 0x8086, 0xA780, VGA, rev=0x04, driver="i915")


def nvidia_pair_am5(root: Path) -> None:
    """Two RTX 4090 on X670E x8/x8; the first idles at 2.5 GT/s (NVIDIA power saving)."""
    t = Tree(root)
    for port, bus, gen in (("0000:00:01.1", 0x01, 1), ("0000:00:01.2", 0x02, 4)):
        t.dev(["pci0000:00", port], 0x1022, 0x14DB, BRIDGE, cur=(gen, 8), max_=(5, 8))
        nvidia_gpu(t, ["pci0000:00", port, f"0000:{bus:02x}:00.0"], 0x2684, (gen, 8), (4, 16))


def vm_passthrough_h200(root: Path) -> None:
    """What a cloud VM shows (captured from an H200 guest): the GPU straight on the virtual host
    bridge, no root port, numa_node -1, a 256 GiB BAR."""
    t = Tree(root)
    t.dev(["pci0000:00", "0000:00:06.0"], 0x10DE, 0x2335, VGA, rev=0xA1, cur=(5, 16), max_=(5, 16),
          driver="nvidia", files={"resource": _resource(256 * GIB), "local_cpulist": "0-15"})


BUILDERS = {"am5_x16": am5_x16, "am5_x8x8": am5_x8x8, "am5_chipset_x4": am5_chipset_x4,
            "threadripper_x16x16": threadripper_x16x16, "intel_z790_pch": intel_z790_pch,
            "nvidia_pair_am5": nvidia_pair_am5, "vm_passthrough_h200": vm_passthrough_h200}


def build_all(target: Path = FIXTURES) -> None:
    for name, build in BUILDERS.items():
        shutil.rmtree(target / name, ignore_errors=True)
        build(target / name)


if __name__ == "__main__":
    build_all(Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURES)
