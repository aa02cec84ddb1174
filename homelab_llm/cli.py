"""`homelab-llm`: one front door. Each subcommand lives in its room's `command` module, imported
only when chosen, so `homelab-llm hwcheck` never pays for importing torch."""

from __future__ import annotations

import argparse
import importlib
import sys

from homelab_llm import __version__
from homelab_llm.errors import HomelabError
from homelab_llm.parent_watch import start_from_env

# name -> (module with add_parser(subparsers) and run(args) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "tui": ("homelab_llm.tui.command", "open the control app (the default)"),
    "serve": ("homelab_llm.server.command", "serve a model over an OpenAI-compatible API"),
    "generate": ("homelab_llm.engine.command", "generate a completion offline and print it"),
    "bench": ("homelab_llm.bench.command", "benchmark any OpenAI-compatible server or the engine"),
    "hwcheck": ("homelab_llm.hwcheck.command", "detect GPUs, PCIe links and P2P; check a planned build"),
    "plan": ("homelab_llm.hwcheck.plan_command", "plan memory: weights, KV, context and concurrency"),
    "presets": ("homelab_llm.tui.presets_command", "list and show service presets"),
    "models": ("homelab_llm.models.command", "list models on disk with fit verdicts"),
    "pull": ("homelab_llm.models.pull_command", "download a model from the Hugging Face Hub"),
    "router": ("homelab_llm.router.command", "one OpenAI endpoint in front of every preset"),
}


DESCRIPTION = """\
Run LLMs at home: a control app (the default command) that starts presets as a
child service and shows what they do, its own inference engine behind an
OpenAI-compatible API, a hardware check, a memory planner and benchmarks."""
EPILOG = """\
Run `homelab-llm COMMAND --help` for a command's flags. With no command, or
only flags, the control app opens: `homelab-llm --url http://127.0.0.1:8000`
watches a server that is already running."""


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    from homelab_llm.settings import settings_path

    parser = argparse.ArgumentParser(
        prog="homelab-llm", description=DESCRIPTION,
        epilog=EPILOG + f"\n\nSettings file: {settings_path()} (TOML: models_dirs, "
               "default_preset, router_port;\nHOMELAB_LLM_CONFIG names another).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"homelab-llm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        if name == chosen:
            importlib.import_module(module).add_parser(sub)
        else:  # keep --help cheap: a placeholder; the real parser is built when chosen
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    start_from_env()  # launched by the control app: end when it ends (no orphans)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["tui", *argv]
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except HomelabError as err:
        print(f"homelab-llm {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
