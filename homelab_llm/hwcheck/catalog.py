"""The hardware catalog (assets/hardware/*.toml, plus the user's own entries) and build files.

Catalog files hold tables by kind and id, each with the source of its facts:

    [gpu.rtx-4090-fe]
    name = "NVIDIA GeForce RTX 4090 Founders Edition"
    length_mm = 304
    ...
    source = "https://..."                          # covers every fact not listed below
    sources = { tdp_w = "https://..." }             # a different source for one fact

User entries live in <user config dir>/homelab-llm/hardware/*.toml and replace shipped ones by id.
A build file names catalog entries by `ref` and may override any field inline.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from homelab_llm.assets import assets_dir
from homelab_llm.errors import HomelabError
from homelab_llm.hwcheck.fit import Board, Build, Card, Case, Placement, Psu, Slot, thickness_from_mm

KINDS = ("gpu", "board", "case", "psu")
# Facts that need a source, per kind (names and ids are not facts).
FACTS: dict[str, tuple[str, ...]] = {
    "gpu": ("length_mm", "thickness_slots", "tdp_w", "power_connectors"),
    "board": ("slots",),
    "case": ("expansion_slots", "max_gpu_length_mm"),
    "psu": ("watts", "connectors"),
}
CONNECTOR_KINDS = ("pcie_8pin", "12v_2x6", "12pin")


class CatalogError(HomelabError, ValueError):
    """A catalog or build file that cannot be read; the message names the file, entry and field."""


@dataclass
class Catalog:
    entries: dict[str, dict[str, dict[str, Any]]] = field(
        default_factory=lambda: {k: {} for k in KINDS})
    origin: dict[tuple[str, str], str] = field(default_factory=dict)  # (kind, id) -> file

    def ids(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])

    def sources(self, kind: str, entry_id: str) -> dict[str, str | None]:
        """Fact -> the URL it comes from (None: no source given)."""
        raw = self.entries[kind][entry_id]
        per_fact = raw.get("sources") or {}
        return {f: per_fact.get(f) or raw.get("source") for f in FACTS[kind] if f in raw}

    def get(self, kind: str, entry_id: str) -> Any:
        if entry_id not in self.entries[kind]:
            known = ", ".join(self.ids(kind)) or "none"
            raise CatalogError(f"no {kind} {entry_id!r} in the catalog (known: {known})")
        return build_entry(kind, entry_id, self.entries[kind][entry_id], self.origin[(kind, entry_id)])


def user_hardware_dir() -> Path:
    import platformdirs  # only when someone asks for user entries

    return Path(platformdirs.user_config_dir("homelab-llm")) / "hardware"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise CatalogError(f"cannot read {path}: {err.strerror or err}") from err
    except tomllib.TOMLDecodeError as err:
        raise CatalogError(f"{path}: not valid TOML ({err})") from err


def load_catalog(dirs: list[Path] | None = None) -> Catalog:
    """Shipped entries, then the user's (later files replace earlier ones by id)."""
    if dirs is None:
        dirs = [assets_dir() / "hardware", user_hardware_dir()]
    catalog = Catalog()
    for directory in dirs:
        for path in sorted(directory.glob("*.toml")) if directory.is_dir() else []:
            data = _read_toml(path)
            for kind, table in data.items():
                if kind not in KINDS or not isinstance(table, dict):
                    raise CatalogError(f"{path}: unknown table [{kind}]; use {', '.join(KINDS)}")
                for entry_id, raw in table.items():
                    if not isinstance(raw, dict):
                        raise CatalogError(f"{path}: [{kind}.{entry_id}] must be a table")
                    build_entry(kind, entry_id, raw, str(path))  # validate now, fail early
                    catalog.entries[kind][entry_id] = raw
                    catalog.origin[(kind, entry_id)] = str(path)
    return catalog


def _num(raw: dict[str, Any], key: str, where: str, *, positive: bool = True) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CatalogError(f"{where}: {key} must be a number, got {value!r}")
    if positive and value <= 0:
        raise CatalogError(f"{where}: {key} must be positive, got {value}")
    return value


def _connectors(raw: dict[str, Any], key: str, where: str) -> dict[str, int]:
    table = raw.get(key, {})
    if not isinstance(table, dict):
        raise CatalogError(f"{where}: {key} must be a table like {{ pcie_8pin = 2 }}")
    out = {}
    for name, count in table.items():
        if name not in CONNECTOR_KINDS:
            raise CatalogError(f"{where}: connector {name!r} unknown; use {', '.join(CONNECTOR_KINDS)}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise CatalogError(f"{where}: {key}.{name} must be a whole number >= 0")
        out[name] = count
    return out


def _slot(raw: Any, where: str) -> Slot:
    if not isinstance(raw, dict):
        raise CatalogError(f"{where}: each slot must be a table")
    name = str(raw.get("name", ""))
    w = f"{where} slot {name or '?'}"
    lanes = raw.get("lanes")
    if lanes not in ("cpu", "chipset"):
        raise CatalogError(f"{w}: lanes must be 'cpu' or 'chipset', got {lanes!r}")
    shared = raw.get("shared_width")
    return Slot(
        name=name or f"slot{raw.get('position')}", position=int(_num(raw, "position", w)),
        physical_width=int(_num(raw, "physical_width", w)),
        electrical_width=int(_num(raw, "electrical_width", w)), gen=int(_num(raw, "gen", w)),
        lanes=lanes, shared_width=int(shared) if isinstance(shared, int) else None,
        shares_with=tuple(str(s) for s in raw.get("shares_with", ())),
        open_ended=bool(raw.get("open_ended", False)),
    )


def build_entry(kind: str, entry_id: str, raw: dict[str, Any], origin: str) -> Any:
    where = f"{origin} [{kind}.{entry_id}]"
    name = str(raw.get("name", entry_id))
    if kind == "gpu":
        if "thickness_slots" in raw:
            thickness = _num(raw, "thickness_slots", where)
        elif "thickness_mm" in raw:
            thickness = thickness_from_mm(_num(raw, "thickness_mm", where))
        else:
            raise CatalogError(f"{where}: give thickness_slots or thickness_mm")
        return Card(entry_id, name, _num(raw, "length_mm", where), thickness,
                    int(_num(raw, "tdp_w", where)), _connectors(raw, "power_connectors", where),
                    bool(raw.get("transient_class", False)), str(raw.get("vendor", "")),
                    int(raw.get("vram_gib", 0) or 0))
    if kind == "board":
        slots = raw.get("slots")
        if not isinstance(slots, list) or not slots:
            raise CatalogError(f"{where}: slots must be a list of [[...slots]] tables")
        return Board(entry_id, name, tuple(_slot(s, where) for s in slots),
                     str(raw.get("form_factor", "ATX")))
    if kind == "case":
        return Case(entry_id, name, int(_num(raw, "expansion_slots", where)),
                    _num(raw, "max_gpu_length_mm", where),
                    int(raw.get("vertical_mount_slots", 0) or 0))
    if kind == "psu":
        return Psu(entry_id, name, int(_num(raw, "watts", where)),
                   _connectors(raw, "connectors", where))
    raise CatalogError(f"{origin}: unknown kind {kind!r}")


def _resolve(kind: str, raw: Any, catalog: Catalog, origin: str, label: str) -> Any:
    """A build file's table: a catalog `ref`, inline fields, or a ref with overrides."""
    if isinstance(raw, str):
        raw = {"ref": raw}
    if not isinstance(raw, dict):
        raise CatalogError(f"{origin}: [{label}] must be a table or a catalog id")
    merged: dict[str, Any] = {}
    ref = raw.get("ref")
    if ref is not None:
        catalog.get(kind, str(ref))  # a clear error for an unknown id
        merged.update(catalog.entries[kind][str(ref)])
    merged.update({k: v for k, v in raw.items() if k not in ("ref", "slot", "riser")})
    return build_entry(kind, str(ref or label), merged, origin)


def load_build(path: str | Path, catalog: Catalog | None = None) -> Build:
    path = Path(path)
    catalog = catalog or load_catalog()
    data = _read_toml(path)
    origin = str(path)
    for required in ("board", "case", "psu", "gpu"):
        if required not in data:
            raise CatalogError(f"{origin}: missing [{required}]" + (
                " (one [[gpu]] table per card, with ref and slot)" if required == "gpu" else ""))
    gpus = data["gpu"] if isinstance(data["gpu"], list) else [data["gpu"]]
    placements = []
    for i, g in enumerate(gpus):
        if not isinstance(g, dict) or "slot" not in g:
            raise CatalogError(f"{origin}: [[gpu]] #{i + 1} needs slot = \"<board slot name>\"")
        card = _resolve("gpu", g, catalog, origin, f"gpu #{i + 1}")
        placements.append(Placement(card, str(g["slot"]), bool(g.get("riser", False))))
    cpu = data.get("cpu_watts", 120)
    if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0:
        raise CatalogError(f"{origin}: cpu_watts must be a whole number of watts")
    return Build(_resolve("board", data["board"], catalog, origin, "board"),
                 _resolve("case", data["case"], catalog, origin, "case"),
                 _resolve("psu", data["psu"], catalog, origin, "psu"), tuple(placements), cpu)


def make_build(catalog: Catalog, board: str, case: str, psu: str,
               gpus: list[tuple[str, str, bool]], cpu_watts: int = 120) -> Build:
    """A build from catalog ids, as a step-by-step form collects them: gpus are
    (gpu id, slot name, on a riser)."""
    if cpu_watts < 0:
        raise CatalogError("cpu_watts must be a whole number of watts")
    return Build(catalog.get("board", board), catalog.get("case", case), catalog.get("psu", psu),
                 tuple(Placement(catalog.get("gpu", g), slot, riser) for g, slot, riser in gpus),
                 cpu_watts)
