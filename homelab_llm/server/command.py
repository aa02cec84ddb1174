"""`homelab-llm serve [MODEL]`: the engine behind an OpenAI-compatible API. Flags are spelled like
`vllm serve`'s; `--preset NAME` supplies defaults that flags on the command line override."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import Any

from homelab_llm.errors import HomelabError

API_KEY_ENV = "HOMELAB_LLM_API_KEY"


@dataclass(frozen=True)
class _Default:
    """Marks a value argparse filled in, so a preset may replace it but not an explicit flag."""

    value: Any


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from homelab_llm.engine.args import EngineArgs

    p.add_argument("model", nargs="?", default="",
                   help="GGUF file, HF folder, or model_configs JSON with --load-format dummy "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    EngineArgs.add_cli_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (0.0.0.0 for the LAN; set --api-key then)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use as `model` (default: the model file's name)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set)")
    g.add_argument("--max-queue-len", type=int, default=None,
                   help="requests waiting for their first token before new ones get 429")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGTERM before being aborted")
    g.add_argument("--preset", default=None, help="start from a saved preset; flags override it")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="the HTTP server's log level; debug also logs every request (default: info)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible API",
                              description=" ".join(__doc__.split()))
    _add_arguments(p)
    for action in p._actions:  # argparse has no public "was this flag given?"
        if action.dest != "help" and action.default is not argparse.SUPPRESS:
            action.default = _Default(action.default)
    p.set_defaults(run=run)


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults < preset < explicit flags."""
    explicit = {k: v for k, v in vars(args).items() if not isinstance(v, _Default)}
    merged = {k: (v.value if isinstance(v, _Default) else v) for k, v in vars(args).items()}
    if merged.get("preset"):
        merged.update(_preset_values(merged["preset"]))
        merged.update(explicit)
    return argparse.Namespace(**merged)


def _preset_values(name: str) -> dict[str, Any]:
    try:
        from homelab_llm.presets import load_preset
    except ImportError as err:
        raise HomelabError(f"--preset needs homelab_llm.presets, which is not available: {err}") from err
    preset = load_preset(name)
    if preset.backend != "builtin":
        raise HomelabError(f"preset {name!r} runs backend {preset.backend!r}, not homelab-llm; "
                           f"start it from the TUI or with that backend's own command")
    parser = argparse.ArgumentParser(prog=f"preset {name}", exit_on_error=False,
                                     argument_default=argparse.SUPPRESS)
    _add_arguments(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # keep only what the preset sets
    try:
        values = vars(parser.parse_args(preset.to_cli_args()))
    except (argparse.ArgumentError, SystemExit) as err:
        raise HomelabError(f"preset {name!r} has an argument `serve` does not accept: {err}") from err
    values.update(host=preset.host, port=preset.port)
    return values


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from homelab_llm.engine.args import EngineArgs

    args = resolve_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.model:
        from homelab_llm.assets import default_model_path

        try:
            args.model = str(default_model_path())
        except FileNotFoundError as err:
            raise HomelabError(str(err)) from err
    if args.max_queue_len is not None and args.max_queue_len < 1:
        raise HomelabError(f"--max-queue-len must be >= 1, got {args.max_queue_len}")
    if args.drain_timeout < 0:
        raise HomelabError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if not 0 <= args.port <= 65535:
        raise HomelabError(f"--port must be in [0, 65535], got {args.port}")
    engine_args = EngineArgs.from_cli(args)  # validates; errors are one-line HomelabErrors
    if engine_args.node_rank > 0:
        # Another node of a multi-node TP group: run this node's ranks, no HTTP server.
        from homelab_llm.engine.parallel_workers import serve_worker_node

        logging.getLogger("homelab_llm.server").info(
            "node %d of %d: serving ranks for %s:%d", engine_args.node_rank, engine_args.nnodes,
            engine_args.master_addr, engine_args.master_port)
        return serve_worker_node(engine_args)

    from homelab_llm.server.app import build_app
    from homelab_llm.server.launch import serve
    from homelab_llm.server.state import ServerConfig

    names = tuple(args.served_model_name or [Path(args.model).stem])
    config = ServerConfig(served_model_names=names, model_path=args.model,
                          api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                          max_queue_len=args.max_queue_len, drain_timeout_s=args.drain_timeout)

    def load_engine() -> Any:
        from homelab_llm.engine.core import LLMEngine

        return LLMEngine(engine_args)

    logging.getLogger("homelab_llm.server").info("loading %s", args.model)
    return serve(build_app(config, load_engine), args.host, args.port, args.uvicorn_log_level)
