"""`homelab-llm presets list|show NAME|path`: what the TUI's Presets screen shows, for scripts."""

from __future__ import annotations

import argparse
import shlex

from homelab_llm.presets import dump_preset, load_preset, scan_presets, user_presets_dir


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("presets", help="list and show service presets",
                                   description="List and show service presets (built-in and user).")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.add_parser("list", help="every preset: name, backend, source, description")
    show = actions.add_parser("show", help="a preset's TOML and the command it launches")
    show.add_argument("name")
    actions.add_parser("path", help="the folder where user presets live")
    parser.set_defaults(run=run, action="list")


def run(args: argparse.Namespace) -> int:
    if args.action == "path":
        print(user_presets_dir())
        return 0
    if args.action == "show":
        from homelab_llm.tui.launch import launch_command

        preset = load_preset(args.name)
        print(f"# {preset.source}")
        print(dump_preset(preset), end="")
        print(f"\n# launches: {shlex.join(launch_command(preset, resolve_model=False))}")
        return 0
    scan = scan_presets()
    width = max((len(p.name) for p in scan.presets), default=4)
    print(f"{'NAME':<{width}}  {'BACKEND':<9}  {'SOURCE':<7}  DESCRIPTION")
    for preset in scan.presets:
        source = "builtin" if preset.builtin else "user"
        print(f"{preset.name:<{width}}  {preset.backend:<9}  {source:<7}  {preset.description}")
    for path, error in scan.broken.items():  # shown, so a typo never makes a preset vanish silently
        print(f"broken: {path}: {error}")
    return 1 if scan.broken else 0
