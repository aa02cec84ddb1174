"""`homelab-llm hwcheck`: what GPUs and links this machine has; `hwcheck build FILE.toml`: will a
planned build work. Torch-free: it reads sysfs and, when installed, pyamdgpuinfo / NVML."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from homelab_llm.errors import HomelabError


class HwcheckError(HomelabError, ValueError):
    """Bad hwcheck input (a --sysfs-root that is not a directory, ...)."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "hwcheck", help="detect GPUs, PCIe links and P2P; check a planned build",
        description="Detect GPUs, their PCIe links (slowest hop to the CPU), CPU vs chipset lanes, "
                    "NUMA and P2P. `hwcheck build FILE.toml` checks a planned build instead.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a report")
    parser.add_argument("--sysfs-root", default="/", metavar="DIR",
                        help="read sys/ under DIR instead of / (fixture trees, containers)")
    parser.add_argument("--no-vendor-libs", action="store_true",
                        help="sysfs only: skip pyamdgpuinfo and NVML")
    sub = parser.add_subparsers(dest="hwcheck_action", metavar="ACTION")
    build = sub.add_parser("build", help="check a planned build: fit, lanes, power",
                           description="Check a build file against the hardware catalog "
                                       "(assets/hardware plus your own entries). Start from "
                                       "`hwcheck build --example my-pc.toml`.")
    build.add_argument("file", metavar="FILE.toml", nargs="?",
                       help="the build to check (with --example: where to write the example)")
    build.add_argument("--example", action="store_true",
                       help="write a commented example build to FILE.toml (or print it) and exit")
    build.add_argument("--json", action="store_true", dest="build_json",
                       help="print JSON instead of a report")
    catalog = sub.add_parser("catalog", help="list the hardware catalog's entries")
    catalog.add_argument("--json", action="store_true", dest="catalog_json")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    action = getattr(args, "hwcheck_action", None)
    if action == "build" and args.example:
        return write_example(args.file)
    if action == "build":
        if args.file is None:
            raise HwcheckError("hwcheck build needs FILE.toml; `hwcheck build --example FILE.toml` "
                               "writes one to start from")
        return run_build(args.file, args.json or args.build_json)
    if action == "catalog":
        return run_catalog(args.json or args.catalog_json)
    return run_detect(args.sysfs_root, args.json, vendor_libs=not args.no_vendor_libs)


def run_detect(sysfs_root: str, as_json: bool, vendor_libs: bool = True) -> int:
    from homelab_llm.hwcheck.backends import AUTO
    from homelab_llm.hwcheck.report import make_report, render_text

    if not Path(sysfs_root).is_dir():
        raise HwcheckError(f"--sysfs-root {sysfs_root!r} is not a directory")
    lib = AUTO if vendor_libs else None
    report = make_report(sysfs_root, amd=lib, nvml=lib)
    if as_json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        print()
    else:
        print(render_text(report))
    return 0


def write_example(path: str | None) -> int:
    from homelab_llm.hwcheck.build_file import example_toml

    if path is None:
        print(example_toml(), end="")
        return 0
    target = Path(path)
    if target.exists():
        raise HwcheckError(f"{path} exists already; give --example a new file name")
    target.write_text(example_toml())
    print(f"wrote {path}; check it with `homelab-llm hwcheck build {path}`")
    return 0


def run_build(path: str, as_json: bool) -> int:
    from homelab_llm.hwcheck.catalog import load_build
    from homelab_llm.hwcheck.fit import check_build, overall

    build = load_build(path)
    verdicts = check_build(build)
    verdict = overall(verdicts)
    if as_json:
        json.dump({"overall": verdict, "verdicts": [
            {"rule": v.rule, "status": v.status, "reason": v.reason,
             "suggestions": list(v.suggestions)} for v in verdicts]}, sys.stdout, indent=2)
        print()
    else:
        cards = ", ".join(f"{p.card.name} in {p.slot}{' (riser)' if p.riser else ''}"
                          for p in build.placements)
        print(f"{build.board.name} / {build.case.name} / {build.psu.name}: {cards}")
        for v in verdicts:
            print(f"[{v.status:>4}] {v.rule}: {v.reason}")
            for s in v.suggestions:
                print(f"         - {s}")
        print(f"overall: {verdict}")
    return 1 if verdict == "fail" else 0


def run_catalog(as_json: bool) -> int:
    from homelab_llm.hwcheck.catalog import KINDS, load_catalog

    catalog = load_catalog()
    if as_json:
        json.dump({k: catalog.entries[k] for k in KINDS}, sys.stdout, indent=2)
        print()
        return 0
    for kind in KINDS:
        print(f"{kind}:")
        for entry_id in catalog.ids(kind):
            raw = catalog.entries[kind][entry_id]
            print(f"  {entry_id:<34} {raw.get('name', '')}")
    return 0
