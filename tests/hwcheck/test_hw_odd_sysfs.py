"""An odd sysfs never raises: missing files, garbage, binary junk, EACCES, loops."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from homelab_llm.hwcheck import sysfs
from homelab_llm.hwcheck.report import make_report, render_text
from tests.hwcheck.hwcheck_fixtures import BRIDGE, VGA, Tree, am5_x8x8


def test_garbage_and_missing_attributes(tmp_path: Path) -> None:
    t = Tree(tmp_path)
    t.dev(["pci0000:00", "0000:00:01.1"], 0x1022, 0x14DB, BRIDGE, cur=(4, 16), max_=(5, 16))
    gpu = t.dev(["pci0000:00", "0000:00:01.1", "0000:01:00.0"], 0x1002, 0x744C, VGA)
    (gpu / "current_link_speed").write_text("fast\n")
    (gpu / "current_link_width").write_text("-3\n")
    (gpu / "numa_node").write_bytes(b"\xff\xfe\x00")
    (gpu / "mem_info_vram_total").write_text("lots\n")
    (gpu / "revision").unlink()
    (gpu / "resource").write_text("zz yy\n\n0x10 0x0f 0x0\n")
    (gpu / "gpu_busy_percent").write_text("250\n")  # out of range
    (gpu / "hwmon" / "hwmon0").mkdir(parents=True)
    (gpu / "hwmon" / "hwmon0" / "temp1_input").mkdir()  # a directory where a file should be
    r = make_report(tmp_path, amd=None, nvml=None)
    (g,) = r.gpus
    assert g.name == "Radeon RX 7900 series"  # no revision: the family name
    assert (g.vram_bytes, g.numa_node, g.bar_bytes, g.load_pct, g.temperature_c) == (
        None, None, None, None, None)
    # the GPU's own link is unreadable: the root port's side of the hop fills in
    assert (g.link.current_gen, g.link.current_width) == (4, 16)
    assert render_text(r)


def test_unreadable_files_and_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    am5_x8x8(tmp_path)
    real_open, real_listdir = open, os.listdir

    def guarded_open(path, *a, **kw):
        if str(path).endswith(("mem_info_vram_total", "max_link_speed", "properties")):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **kw)

    def guarded_listdir(path):
        if str(path).endswith("hwmon") or str(path).endswith("0000:00:01.2"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_listdir(path)

    monkeypatch.setattr(sysfs, "open", guarded_open, raising=False)
    monkeypatch.setattr(os, "listdir", guarded_listdir)
    r = make_report(tmp_path, amd=None, nvml=None)
    gpus = [g for g in r.gpus if not g.integrated]
    # the second card hides behind an unlistable root port: one discrete GPU remains
    assert [g.pci_address for g in gpus] == ["0000:03:00.0"]
    assert gpus[0].vram_bytes is None and gpus[0].temperature_c is None
    assert gpus[0].link.max_gen is None and gpus[0].link.current_width == 8


def test_symlink_loops_and_non_pci_names_are_skipped(tmp_path: Path) -> None:
    t = Tree(tmp_path)
    port = t.dev(["pci0000:00", "0000:00:01.1"], 0x1022, 0x14DB, BRIDGE, cur=(4, 16), max_=(4, 16))
    t.dev(["pci0000:00", "0000:00:01.1", "0000:01:00.0"], 0x10DE, 0x2684, VGA, cur=(4, 16),
          max_=(4, 16))
    (port / "0000:09:00.0").symlink_to(port)  # a loop back to the parent
    (port / "power").mkdir()
    (tmp_path / "sys" / "devices" / "pci0000:00" / "not-a-device").mkdir()
    r = make_report(tmp_path, amd=None, nvml=None)
    assert [g.pci_address for g in r.gpus] == ["0000:01:00.0"]


def test_link_trained_below_both_ends_warns_with_the_hop(tmp_path: Path) -> None:
    t = Tree(tmp_path)
    t.dev(["pci0000:00", "0000:00:01.1"], 0x1022, 0x14DB, BRIDGE, cur=(4, 8), max_=(5, 16))
    t.dev(["pci0000:00", "0000:00:01.1", "0000:01:00.0"], 0x10DE, 0x2684, VGA, cur=(4, 8),
          max_=(4, 16))
    r = make_report(tmp_path, amd=None, nvml=None)
    (g,) = r.gpus
    assert (g.link.current_width, g.link.max_width) == (8, 16)
    assert any("trained x8 of x16 possible" in w.message for w in r.warnings)


@pytest.mark.parametrize("raw, expected", [("0x1002", 0x1002), ("16", 16), ("  7 \n", 7),
                                           ("x", None), ("", None)])
def test_read_int(tmp_path: Path, raw: str, expected) -> None:
    (tmp_path / "f").write_text(raw)
    assert sysfs.read_int(tmp_path / "f", 16 if raw.startswith("0x") else 10) == expected


@pytest.mark.parametrize("address, expected", [("00000000:01:00.0", "0000:01:00.0"),
                                               ("0000:0A:00.1", "0000:0a:00.1"),
                                               ("01:00.0", None), ("", None), ("0000:01:00.9", None)])
def test_normalize_bdf(address: str, expected) -> None:
    assert sysfs.normalize_bdf(address) == expected


def test_gen3_link_warns_even_at_x16(tmp_path: Path) -> None:
    """A PCIe 3.0 board (e.g. X470): a 3090 trains Gen3 x16, its most: still ~15.8 GB/s."""
    t = Tree(tmp_path)
    t.dev(["pci0000:00", "0000:00:03.1"], 0x1022, 0x1453, BRIDGE, cur=(3, 16), max_=(3, 16))
    t.dev(["pci0000:00", "0000:00:03.1", "0000:09:00.0"], 0x10DE, 0x2204, VGA, cur=(3, 16),
          max_=(4, 16))
    r = make_report(tmp_path, amd=None, nvml=None)
    (w,) = r.warnings
    assert "Gen3 x16 at best (~15.8 GB/s each way)" in w.message
