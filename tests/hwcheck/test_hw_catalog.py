"""The shipped hardware catalog, user overrides, and build files."""

from __future__ import annotations

from pathlib import Path

import pytest

from homelab_llm.assets import assets_dir
from homelab_llm.hwcheck.catalog import FACTS, KINDS, CatalogError, load_build, load_catalog

SHIPPED = assets_dir() / "hardware"


@pytest.fixture(scope="module")
def catalog():
    return load_catalog([SHIPPED])


def test_catalog_covers_the_issue_list(catalog) -> None:
    gpus = catalog.ids("gpu")
    for needed in ("amd-7900xtx-reference", "sapphire-nitro-plus-7900xtx", "rtx-3090-fe",
                   "rtx-4090-fe", "asus-tuf-rtx-4090", "rtx-5090-fe", "asus-rog-astral-rtx-5090"):
        assert needed in gpus
    boards = " ".join(catalog.entries["board"][b]["name"] for b in catalog.ids("board"))
    assert "X670E" in boards and "B650" in boards and "Z790" in boards
    assert len(catalog.ids("case")) >= 3 and len(catalog.ids("psu")) >= 3
    for kind in KINDS:
        for entry_id in catalog.ids(kind):
            catalog.get(kind, entry_id)  # every entry builds


def test_every_fact_has_a_source(catalog) -> None:
    for kind in KINDS:
        for entry_id in catalog.ids(kind):
            sources = catalog.sources(kind, entry_id)
            present = {f for f in FACTS[kind] if f in catalog.entries[kind][entry_id]}
            present |= {"thickness_slots"} if "thickness_mm" in catalog.entries[kind][entry_id] else set()
            for fact in present & set(sources):
                assert str(sources[fact]).startswith("https://"), (kind, entry_id, fact)
            assert "verified" in catalog.entries[kind][entry_id], (kind, entry_id)


def test_user_entries_override_and_extend(tmp_path: Path, catalog) -> None:
    (tmp_path / "mine.toml").write_text(
        '[psu.corsair-rm850x-2021]\nname = "My RM850x"\nwatts = 850\n'
        'connectors = { pcie_8pin = 6 }\nsource = "https://example.org/my-psu"\n'
        '[case.my-rack]\nname = "4U rack"\nexpansion_slots = 8\nmax_gpu_length_mm = 380\n'
        'source = "https://example.org/rack"\n')
    merged = load_catalog([SHIPPED, tmp_path])
    assert merged.get("psu", "corsair-rm850x-2021").connectors == {"pcie_8pin": 6}
    assert merged.get("case", "my-rack").expansion_slots == 8
    assert len(merged.ids("gpu")) == len(catalog.ids("gpu"))


@pytest.mark.parametrize("text, needle", [
    ('[gpu.x]\nlength_mm = "long"\nthickness_slots = 2\ntdp_w = 300\n', "length_mm must be a number"),
    ('[gpu.x]\nlength_mm = 300\ntdp_w = 300\n', "thickness_slots or thickness_mm"),
    ('[gpu.x]\nlength_mm = 300\nthickness_slots = 2\ntdp_w = 300\npower_connectors = { molex = 2 }\n',
     "connector 'molex' unknown"),
    ('[board.b]\nslots = [{ name = "A", position = 1, physical_width = 16, electrical_width = 16, '
     'gen = 4, lanes = "pch" }]\n', "lanes must be 'cpu' or 'chipset'"),
    ('[cpu.x]\nname = "?"\n', "unknown table [cpu]"),
    ('[psu.p\nwatts = 1\n', "not valid TOML"),
])
def test_bad_catalog_entries_name_file_entry_and_field(tmp_path: Path, text: str, needle: str) -> None:
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(CatalogError, match=None) as err:
        load_catalog([tmp_path])
    assert needle in str(err.value) and "bad.toml" in str(err.value)


def write_build(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "build.toml"
    path.write_text(body)
    return path


def test_build_file_with_refs_and_inline_overrides(tmp_path: Path, catalog) -> None:
    path = write_build(tmp_path, """
cpu_watts = 170
board = "asus-proart-x670e-creator"
case = { ref = "fractal-meshify-2", expansion_slots = 8 }
[psu]
name = "Generic 850 W"
watts = 850
connectors = { pcie_8pin = 4, "12v_2x6" = 1 }
[[gpu]]
ref = "rtx-5090-fe"
slot = "PCIEX16_1"
[[gpu]]
ref = "rtx-4090-fe"
slot = "PCIEX16_2"
riser = true
""")
    build = load_build(path, catalog)
    assert build.case.expansion_slots == 8 and build.case.name == "Fractal Design Meshify 2"
    assert build.psu.watts == 850 and build.cpu_watts == 170
    assert [(p.card.id, p.slot, p.riser) for p in build.placements] == [
        ("rtx-5090-fe", "PCIEX16_1", False), ("rtx-4090-fe", "PCIEX16_2", True)]


@pytest.mark.parametrize("body, needle", [
    ('board = "b"\ncase = "c"\npsu = "p"\n', "missing [gpu]"),
    ('board = "nope"\ncase = "fractal-meshify-2"\npsu = "corsair-rm850x-2021"\n'
     '[[gpu]]\nref = "rtx-4090-fe"\nslot = "A"\n', "no board 'nope' in the catalog"),
    ('board = "asus-proart-x670e-creator"\ncase = "fractal-meshify-2"\npsu = "corsair-rm850x-2021"\n'
     '[[gpu]]\nref = "rtx-4090-fe"\n', "needs slot ="),
    ('cpu_watts = "lots"\nboard = "asus-proart-x670e-creator"\ncase = "fractal-meshify-2"\n'
     'psu = "corsair-rm850x-2021"\n[[gpu]]\nref = "rtx-4090-fe"\nslot = "A"\n', "cpu_watts"),
])
def test_bad_build_files(tmp_path: Path, catalog, body: str, needle: str) -> None:
    with pytest.raises(CatalogError) as err:
        load_build(write_build(tmp_path, body), catalog)
    assert needle in str(err.value)


def test_make_build_from_form_choices(catalog) -> None:
    from homelab_llm.hwcheck.catalog import make_build
    from homelab_llm.hwcheck.fit import check_build, overall

    build = make_build(catalog, "asus-proart-x670e-creator", "fractal-define-7-xl",
                       "seasonic-prime-tx-1600-atx3",
                       [("amd-7900xtx-reference", "PCIEX16_1", False),
                        ("amd-7900xtx-reference", "PCIEX16_2", False)], cpu_watts=170)
    verdicts = check_build(build)
    # 2.5-slot cards at positions 1 and 4 (3 apart): fit; CPU x8/x8; 355+355+170+100 W on 1600 W
    assert overall(verdicts) == "pass", [v.reason for v in verdicts if v.status != "pass"]
    with pytest.raises(CatalogError, match="no gpu 'rtx-9090'"):
        make_build(catalog, "asus-proart-x670e-creator", "fractal-define-7-xl",
                   "seasonic-prime-tx-1600-atx3", [("rtx-9090", "PCIEX16_1", False)])
