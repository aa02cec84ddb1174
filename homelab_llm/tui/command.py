"""`homelab-llm tui` (also plain `homelab-llm`): open the control app."""

from __future__ import annotations

import argparse
from pathlib import Path

from homelab_llm.errors import HomelabError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tui", help="open the control app (the default)",
        description="Open the control app: start presets as a child service and watch them, "
                    "or watch any OpenAI-compatible server with --url.")
    parser.add_argument("--preset", default="smollm2-cpu",
                        help="the preset selected at start (default: smollm2-cpu)")
    parser.add_argument("--start", action="store_true", help="start the selected preset at once")
    parser.add_argument("--url", default=None,
                        help="watch a server that is already running, e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, help="bearer token for --url and the chat box")
    parser.add_argument("--sysfs-root", default=None, metavar="DIR",
                        help="show the hardware of a recorded sysfs tree under DIR instead of this "
                             "machine's (as `hwcheck --sysfs-root`; for demos and tests)")
    parser.add_argument("--mode", default="dashboard",
                        choices=["dashboard", "presets", "hardware", "logs", "bench"], help="first screen")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from homelab_llm.presets import load_preset
    from homelab_llm.tui.app import HomelabApp
    from homelab_llm.tui.hardware import NoTelemetry, collect_hardware_report
    from homelab_llm.tui.pidfiles import PidFiles
    from homelab_llm.tui.service import ServiceManager

    if args.start:
        load_preset(args.preset)  # a typo is a one-line error here, not a notification later
    extra = {}
    if args.sysfs_root is not None:
        if not Path(args.sysfs_root).is_dir():
            raise HomelabError(f"--sysfs-root {args.sysfs_root!r} is not a directory")
        root = args.sysfs_root
        extra = {"hardware_source": lambda: collect_hardware_report(root),
                 "telemetry": NoTelemetry()}  # this machine's sensors would not match the tree
    app = HomelabApp(service=ServiceManager(pidfiles=PidFiles()), initial_preset=args.preset,
                     autostart=args.start, watch_url=args.url, api_key=args.api_key,
                     start_mode=args.mode, handle_signals=True, **extra)
    code = int(app.run() or 0)
    if app.exit_guard is not None:
        app.exit_guard.arm(code)  # a thread that will not end must not keep the process alive
    return code
