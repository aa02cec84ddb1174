"""`homelab-llm models`: what is on disk, whether the engine runs it, and whether it fits here.

Scans the Hub cache, ~/models, the settings file's models_dirs and every --dir. The fit columns
are `plan` at int8 KV for this machine's GPUs (hwcheck), or for --gpu-memory / -tp.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from homelab_llm.errors import HomelabError


def add_machine_args(p: argparse.ArgumentParser) -> None:
    """--gpu-memory and -tp: the machine a fit verdict is for (models, pull)."""
    from homelab_llm.engine.args import parse_bytes

    p.add_argument("--gpu-memory", type=parse_bytes, default=None, metavar="BYTES",
                   help="memory per GPU, e.g. 24GiB (default: the GPUs hwcheck finds)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="GPUs per model (default: every GPU found, or 1 with --gpu-memory)")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "models", help="list models on disk with fit verdicts",
        description="List GGUF files and HF folders in the Hugging Face cache, ~/models, the "
                    "settings file's models_dirs and --dir: family, parameters, quantization, "
                    "size, engine support, and the largest context / 32K concurrency that fits "
                    "at int8 KV.")
    p.add_argument("--dir", action="append", default=[], metavar="DIR",
                   help="also scan DIR (repeatable)")
    p.add_argument("--only-dirs", action="store_true",
                   help="scan just the --dir folders (not the cache, ~/models or settings)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_machine_args(p)
    p.set_defaults(run=run)
    return p


def machine_from_args(gpu_memory: int | None, tp: int | None) -> Any:
    """The Machine to fit against, or None when there is no GPU and none was given."""
    from homelab_llm.models.fit import Machine, this_machine

    if tp is not None and tp < 1:
        raise HomelabError(f"--tensor-parallel-size must be >= 1, got {tp}")
    if gpu_memory is not None:
        return Machine(gpu_memory, tp or 1, "given")
    found = this_machine()
    if found and tp:
        return Machine(found.gpu_memory_bytes, tp, "detected")
    return found


ScanResult = list[tuple[Any, Any]]  # (LocalModel, Fit | None)


def scan_with_fits(dirs: list[str], only_dirs: bool, machine: Any) -> ScanResult:
    """Every model found with its fit (None: unsupported, or no GPU to fit against)."""
    from homelab_llm.models.fit import fit_model
    from homelab_llm.models.scan import default_dirs, find_models
    from homelab_llm.settings import load_settings

    roots = list(dirs) if only_dirs else default_dirs([*load_settings().models_dirs, *dirs])
    return [(m, fit_model(m.config, machine) if m.config and machine else None)
            for m in find_models(roots)]


def to_json(found: ScanResult) -> list[dict[str, Any]]:
    return [{**m.to_json(), "fit": fit.to_json() if fit else None} for m, fit in found]


def render(found: ScanResult, machine: Any) -> str:
    from homelab_llm.models.format import format_size, params_text, verdict_text, why_not

    if not found:
        return "no models found (add folders with --dir or models_dirs in the settings file)"
    table = [("NAME", "FAMILY", "PARAMS", "QUANT", "SIZE", "FIT (int8 KV)", "PATH")]
    notes = [f"  {m.name}: {why_not(m, fit)}" for m, fit in found if why_not(m, fit)]
    for m, fit in found:
        table.append((m.name, m.family, params_text(m), m.quantization, format_size(m.size_bytes),
                      verdict_text(m, fit), m.path))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in table]
    lines.append(machine_text(machine))
    return "\n".join(lines + notes)


def machine_text(machine: Any) -> str:
    if machine is None:
        return "fit: no GPU found; give --gpu-memory (e.g. 24GiB) and -tp"
    return (f"fit: {machine.tensor_parallel_size} x {machine.gpu_memory_bytes / 2**30:.1f} GiB "
            f"({machine.source}), as `homelab-llm plan MODEL --kv-cache-dtype int8`")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    missing = [d for d in args.dir if not Path(d).expanduser().exists()]
    if missing:
        raise HomelabError(f"--dir {missing[0]}: no such file or folder")
    machine = machine_from_args(args.gpu_memory, args.tensor_parallel_size)
    found = scan_with_fits(args.dir, args.only_dirs, machine)
    if args.json:
        json.dump(to_json(found), sys.stdout, indent=2)
        print()
    else:
        print(render(found, machine))
    return 0
