"""Vendor libraries through fakes: values merged by PCI address, every failure degrades."""

from __future__ import annotations

import pytest

from tests.hwcheck.hw_fakes import FakeAmd, FakeAmdGpu, nvml_4090_pair
from homelab_llm.hwcheck.gpus import detect_gpus
from homelab_llm.hwcheck.report import make_report
from tests.hwcheck.hwcheck_fixtures import FIXTURES


def test_nvml_values_merge_and_p2p_not_supported_is_reported() -> None:
    nvml = nvml_4090_pair(p2p=False)
    r = make_report(FIXTURES / "nvidia_pair_am5", amd=None, nvml=nvml)
    a, b = r.gpus
    assert a.name == "NVIDIA GeForce RTX 4090" and "nvml" in a.sources
    assert (a.vram_bytes, a.vram_used_bytes, a.power_w, a.temperature_c) == (24 << 30, 1 << 30, 30.0, 35)
    # the path's link wins over NVML's own-hop view (NVML says max x16; the slot gives x8)
    assert (a.link.max_width, b.link.current_width) == (8, 8)
    assert r.topology.p2p[0][1] == "NS"
    assert nvml.calls.count("nvmlInit") == 1 and nvml.calls[-1] == "nvmlShutdown"


def test_nvml_p2p_ok() -> None:
    r = make_report(FIXTURES / "nvidia_pair_am5", amd=None, nvml=nvml_4090_pair(p2p=True))
    assert r.topology.p2p == [["X", "OK"], ["OK", "X"]]


def test_nvml_driver_not_loaded_degrades_to_sysfs() -> None:
    nvml = nvml_4090_pair()
    nvml.fail_init = True
    r = make_report(FIXTURES / "nvidia_pair_am5", amd=None, nvml=nvml)
    assert [g.name for g in r.gpus] == ["GeForce RTX 4090"] * 2
    assert all(g.sources == ["sysfs"] and g.vram_bytes is None for g in r.gpus)
    assert r.topology.p2p[0][1] == "?"
    assert "nvmlShutdown" not in nvml.calls  # never initialised, never shut down


def test_nvml_queries_that_raise_leave_fields_empty() -> None:
    nvml = nvml_4090_pair()
    nvml.broken_queries = {"nvmlDeviceGetPowerUsage", "nvmlDeviceGetMemoryInfo",
                           "nvmlDeviceGetP2PStatus", "nvmlDeviceGetName"}
    r = make_report(FIXTURES / "nvidia_pair_am5", amd=None, nvml=nvml)
    a = r.gpus[0]
    assert a.power_w is None and a.vram_bytes is None and a.temperature_c == 35
    assert a.name == "GeForce RTX 4090"  # sysfs name table
    assert r.topology.p2p[0][1] == "?"


def test_nvml_with_garbage_bus_ids_is_ignored() -> None:
    nvml = nvml_4090_pair()
    nvml.gpus[0].bus_id = "not-a-bus-id"
    gpus = detect_gpus(FIXTURES / "nvidia_pair_am5", amd=None, nvml=nvml)
    assert gpus[0].sources == ["sysfs"] and gpus[1].sources == ["sysfs", "nvml"]


def test_pyamdgpuinfo_merges_by_pci_slot() -> None:
    amd = FakeAmd([FakeAmdGpu("0000:06:00.0", "AMD Radeon RX 7900 XTX", 24 << 30, 3 << 30),
                   FakeAmdGpu("0000:03:00.0", None, 24 << 30, 5 << 30, load=0.5)])
    r = make_report(FIXTURES / "am5_x8x8", amd=amd, nvml=None)
    a, b = [g for g in r.gpus if not g.integrated]
    assert (a.pci_address, a.name, a.vram_used_bytes, a.load_pct) == (
        "0000:03:00.0", "Radeon RX 7900 XTX", 5 << 30, 50.0)
    assert (b.name, b.vram_used_bytes, b.power_w) == ("AMD Radeon RX 7900 XTX", 3 << 30, 61.0)
    assert "pyamdgpuinfo" in a.sources


def test_pyamdgpuinfo_query_errors_keep_sysfs_values() -> None:
    amd = FakeAmd([FakeAmdGpu("0000:03:00.0", None, 24 << 30, 0, broken=True)])
    (gpu, _igpu) = detect_gpus(FIXTURES / "am5_x16", amd=amd, nvml=None)
    assert (gpu.vram_used_bytes, gpu.temperature_c, gpu.power_w) == (512 << 20, 41.0, 23.0)


class Exploding:
    def __getattr__(self, name):
        raise RuntimeError("library is broken")


@pytest.mark.parametrize("fixture", ["am5_x8x8", "nvidia_pair_am5"])
def test_a_library_that_raises_everywhere_never_escapes(fixture: str) -> None:
    r = make_report(FIXTURES / fixture, amd=Exploding(), nvml=Exploding())
    assert len([g for g in r.gpus if not g.integrated]) == 2
