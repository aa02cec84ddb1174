"""hwcheck on fixture sysfs trees built from real topologies (see hwcheck_fixtures.py)."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

from homelab_llm.hwcheck.pcie import PciTree, parse_gen, parse_width
from homelab_llm.hwcheck.report import make_report, render_text
from tests.hwcheck.hwcheck_fixtures import FIXTURES, build_all


def report(name: str, **kw):
    return make_report(FIXTURES / name, amd=kw.get("amd"), nvml=kw.get("nvml"))


def discrete(r):
    return [g for g in r.gpus if not g.integrated]


def messages(r) -> str:
    return "\n".join(w.message for w in r.warnings)


def test_committed_fixtures_match_the_builder(tmp_path: Path) -> None:
    build_all(tmp_path)
    def same(a: Path, b: Path) -> bool:
        cmp = filecmp.dircmp(a, b)
        if cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files:
            return False
        return all(same(a / d, b / d) for d in cmp.common_dirs)
    assert same(tmp_path, FIXTURES), "run: python tests/hwcheck/hwcheck_fixtures.py"


def test_am5_x16_sees_the_slot_not_the_radeon_switch() -> None:
    r = report("am5_x16")
    gpu, igpu = r.gpus
    assert (gpu.pci_address, gpu.vendor, gpu.name) == ("0000:03:00.0", "amd", "Radeon RX 7900 XTX")
    assert not gpu.integrated and igpu.integrated
    assert gpu.vram_bytes == 25_753_026_560
    link = gpu.link
    assert (link.current_gen, link.current_width, link.max_gen, link.max_width) == (4, 16, 4, 16)
    assert gpu.attached_to == "cpu" and gpu.root_port == "0000:00:01.1"
    assert (gpu.temperature_c, gpu.power_w, gpu.load_pct) == (41.0, 23.0, 3.0)
    assert r.topology.gpus == ["0000:03:00.0"]  # the iGPU is no tensor-parallel partner
    assert r.warnings == []


def test_am5_x8x8_bifurcated_cpu_slots() -> None:
    r = report("am5_x8x8")
    a, b = discrete(r)
    for g in (a, b):
        # the GPU itself reports x16 (behind the card's switch); the slot hop says x8
        assert (g.link.current_gen, g.link.current_width, g.link.max_width) == (4, 8, 8)
        assert g.link.bottleneck in ("0000:01:00.0", "0000:04:00.0")
        assert g.attached_to == "cpu"
    assert r.topology.connection == [["X", "PHB"], ["PHB", "X"]]
    assert r.topology.p2p == [["X", "OK"], ["OK", "X"]]  # amdkfd lists the peers
    assert r.warnings == []


def test_am5_chipset_x4_slot_warns_and_names_the_switch() -> None:
    r = report("am5_chipset_x4")
    cpu_gpu, chipset_gpu = discrete(r)
    assert cpu_gpu.attached_to == "cpu"
    assert chipset_gpu.attached_to == "chipset"
    assert "Promontory 21" in (chipset_gpu.chipset_switch or "")
    assert (chipset_gpu.link.current_gen, chipset_gpu.link.current_width) == (4, 4)
    text = messages(r)
    assert "0000:0c:00.0 is on chipset lanes" in text
    assert "Gen4 x4 at best (~7.9 GB/s each way)" in text
    assert "Resizable BAR" in text  # 256 MiB BAR < 24 GiB VRAM
    assert r.topology.p2p[0][1] == "NS"  # kernel reports p2p_links, none for this pair
    assert "no P2P between 0000:03:00.0 and 0000:0c:00.0" in text


def test_intel_pch_root_port_is_chipset() -> None:
    r = report("intel_z790_pch")
    g4090, g3090 = discrete(r)
    igpu = next(g for g in r.gpus if g.integrated)
    assert (g4090.name, g4090.attached_to) == ("GeForce RTX 4090", "cpu")
    assert (g3090.name, g3090.attached_to) == ("GeForce RTX 3090", "chipset")
    assert g3090.chipset_switch is None and "PCH root port" in messages(r)
    assert igpu.name == "Intel UHD Graphics 770" and igpu.attached_to == "cpu"
    assert r.topology.p2p[0][1] == "?"  # no NVML: cannot tell


def test_threadripper_two_root_complexes_one_numa_node() -> None:
    r = report("threadripper_x16x16")
    a, b = discrete(r)
    assert (a.link.current_width, b.link.current_width) == (16, 16)
    assert (a.numa_node, b.numa_node) == (0, 0)
    assert r.topology.connection[0][1] == "NODE"
    assert r.topology.p2p[0][1] == "OK"
    assert r.warnings == []


def test_nvidia_pair_idle_link_warns_once_with_the_idle_hint() -> None:
    r = report("nvidia_pair_am5")
    a, b = discrete(r)
    assert (a.link.current_gen, a.link.max_gen, a.link.max_width) == (1, 4, 8)
    text = messages(r)
    assert "runs Gen1 of Gen4 possible (GPUs slow their link when idle" in text
    # judged by what the path can do (Gen4 x8), not by the idle Gen1
    assert "at best" not in text


def test_text_report_has_a_topology_matrix_and_legend() -> None:
    text = render_text(report("am5_x8x8"))
    assert "GPU0  X     PHB" in text and "GPU1  PHB   X" in text
    assert "Legend:" in text and "P2P   GPU0  GPU1" in text
    assert "iGPU  0000:10:00.0" in text


def test_json_shape_matches_the_issue_contract() -> None:
    data = report("am5_chipset_x4").to_json()
    assert set(data) == {"gpus", "topology", "warnings"}
    gpu = data["gpus"][1]
    for key in ("pci_address", "vendor", "name", "integrated", "vram_bytes", "link",
                "attached_to", "numa_node"):
        assert key in gpu
    assert {"current_gen", "current_width", "max_gen", "max_width"} <= set(gpu["link"])
    assert gpu["attached_to"] == "chipset"


@pytest.mark.parametrize("text, gen", [("16.0 GT/s PCIe", 4), ("8 GT/s", 3), ("2.5 GT/s PCIe", 1),
                                       ("32.0 GT/s PCIe", 5), ("Unknown", None), ("", None),
                                       ("7.3 GT/s", None), (None, None)])
def test_parse_gen(text, gen) -> None:
    assert parse_gen(text) == gen


@pytest.mark.parametrize("text, width", [("16", 16), ("x8", 8), ("0", None), ("255", None),
                                         ("garbage", None), (None, None)])
def test_parse_width(text, width) -> None:
    assert parse_width(text) == width


def test_empty_root_has_no_gpus_and_says_so(tmp_path: Path) -> None:
    r = make_report(tmp_path, amd=None, nvml=None)
    assert r.gpus == [] and PciTree.scan(tmp_path).devices == {}
    assert "No GPUs found" in render_text(r)
    assert any("no discrete GPU" in w.message for w in r.warnings)


def test_vm_passthrough_gpu_on_the_host_bridge() -> None:
    """Captured from a cloud H200 guest: no root port, so lanes are unknown, and we say why."""
    from tests.hwcheck.hw_fakes import FakeNvml, FakeNvmlGpu

    nvml = FakeNvml([FakeNvmlGpu("00000000:00:06.0", "NVIDIA H200", 150_754_820_096, 644_939_776,
                                 (5, 16, 5, 16))])
    r = report("vm_passthrough_h200", nvml=nvml)
    (g,) = r.gpus
    assert (g.name, g.attached_to, g.root_port, g.numa_node) == ("NVIDIA H200", "unknown", None, None)
    assert (g.link.current_gen, g.link.current_width, g.link.gbps) == (5, 16, 63.0)
    assert g.bar_bytes == 256 << 30
    (w,) = r.warnings
    assert w.level == "info" and "passthrough" in w.message
