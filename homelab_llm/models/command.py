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


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from homelab_llm.engine.args import parse_bytes

    p = subparsers.add_parser(
        "models", help="list models on disk with fit verdicts",
        description="List GGUF files and HF folders in the Hugging Face cache, ~/models, the "
                    "settings file's models_dirs and --dir: family, parameters, quantization, "
                    "size, engine support, and the largest context / 32K concurrency that fits "
                    "at int8 KV.")
    p.add_argument("--dir", action="append", default=[], metavar="DIR",
                   help="also scan DIR (repeatable); given alone with --only-dirs, only DIR")
    p.add_argument("--only-dirs", action="store_true",
                   help="scan just the --dir folders (not the cache, ~/models or settings)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--gpu-memory", type=parse_bytes, default=None, metavar="BYTES",
                   help="memory per GPU, e.g. 24GiB (default: the GPUs hwcheck finds)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="GPUs per model (default: every GPU found, or 1 with --gpu-memory)")
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


def scan_rows(dirs: list[str], only_dirs: bool, machine: Any) -> list[dict[str, Any]]:
    """One JSON-ready dict per model: its description plus `fit` (None: unsupported or no GPU)."""
    from homelab_llm.models.fit import fit_model
    from homelab_llm.models.scan import default_dirs, find_models
    from homelab_llm.settings import load_settings

    roots = list(dirs) if only_dirs else default_dirs([*load_settings().models_dirs, *dirs])
    rows = []
    for model in find_models(roots):
        row = model.to_json()
        fit = fit_model(model.config, machine) if model.config and machine else None
        row["fit"] = fit.to_json() if fit else None
        rows.append(row)
    return rows


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB"


def _context(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 else str(n)


def render(rows: list[dict[str, Any]], machine: Any) -> str:
    from homelab_llm.models.params import format_params

    if not rows:
        return "no models found (add folders with --dir or models_dirs in the settings file)"
    table = [("NAME", "FAMILY", "PARAMS", "QUANT", "SIZE", "FIT (int8 KV)", "PATH")]
    notes = []
    for r in rows:
        params = format_params(r["params_total"])
        if r["params_active"] is not None and r["params_active"] != r["params_total"]:
            params += f" ({format_params(r['params_active'])} active)"
        if not r["supported"]:
            verdict = "unsupported"
            notes.append(f"{r['name']}: {r['reason']}")
        elif r["fit"] is None:
            verdict = "-"
        elif r["fit"]["fits"]:
            verdict = f"{_context(r['fit']['max_context'])} ctx, {r['fit']['concurrency_32k']}x32K"
        else:
            verdict = "does not fit"
            notes.append(f"{r['name']}: {r['fit']['reason']}")
        table.append((r["name"], r["family"], params, r["quantization"], _size(r["size_bytes"]),
                      verdict, r["path"]))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in table]
    if machine is None:
        lines.append("fit: no GPU found; give --gpu-memory (e.g. 24GiB) and -tp")
    else:
        lines.append(f"fit: {machine.tensor_parallel_size} x {machine.gpu_memory_bytes / 2**30:.1f} "
                     f"GiB ({machine.source}), as `homelab-llm plan MODEL --kv-cache-dtype int8`")
    lines += [f"  {n}" for n in notes]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    machine = machine_from_args(args.gpu_memory, args.tensor_parallel_size)
    rows = scan_rows(args.dir, args.only_dirs, machine)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
    else:
        print(render(rows, machine))
    return 0
