"""`homelab-llm serve [MODEL]`: the engine behind an OpenAI-compatible API. Flags are spelled like
`vllm serve`'s; `--preset NAME` supplies defaults that flags on the command line override.

Order of start-up: check flags, bind the port (a busy one fails in a moment), then load the
model. The API key comes from --api-key, --api-key-file or $HOMELAB_LLM_API_KEY (the last two keep
it out of `ps`); a non-loopback bind without one is served, with a warning."""

from __future__ import annotations

import argparse
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from homelab_llm.errors import HomelabError
from homelab_llm.presets import API_KEY_ENV, exposure_warning, load_preset
from homelab_llm.server import vllm_flags

if TYPE_CHECKING:
    from homelab_llm.engine.args import EngineArgs
    from homelab_llm.server.client_base import Engine


@dataclass(frozen=True)
class _Default:
    """Marks a value argparse filled in, so a preset may replace it but not an explicit flag."""

    value: Any


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from homelab_llm.engine.args import EngineArgs, parse_bytes

    p.add_argument("model", nargs="?", default="",
                   help="GGUF file, HF folder, or model_configs JSON with --load-format dummy "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    EngineArgs.add_cli_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help=f"address to bind (0.0.0.0 for the LAN; set ${API_KEY_ENV} or "
                        f"--api-key-file then)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use as `model` (default: the model file's name)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set; "
                        f"prefer that or --api-key-file: a flag shows in `ps`)")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (its first line)")
    g.add_argument("--allowed-hosts", default="", metavar="A,B",
                   help="extra Host header names to accept (comma-separated; '*' for any). A "
                        "loopback bind accepts only localhost, 127.0.0.1, ::1 and the bound host "
                        "otherwise (DNS-rebinding protection)")
    g.add_argument("--max-request-body-bytes", type=parse_bytes, default=32 << 20, metavar="BYTES",
                   help="larger request bodies get 413 (default 32MiB; e.g. 64MiB)")
    g.add_argument("--max-seqs-per-request", type=int, default=256, metavar="N",
                   help="prompts x n one request may ask for; more is a 400 (default 256)")
    g.add_argument("--max-queue-len", type=int, default=None,
                   help="requests waiting for their first token before new ones get 429")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGTERM before being aborted "
                        "(a second SIGTERM aborts them at once and exits non-zero)")
    g.add_argument("--engine-in-process", action="store_true",
                   help="run the engine loop in a thread of the server process instead of its own "
                        "process (debugging; costs throughput: the two share one GIL)")
    g.add_argument("--preset", default=None, help="start from a saved preset; flags override it")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="the HTTP server's log level; debug also logs every request (default: info)")
    vllm_flags.add_arguments(p)


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
    if args.max_request_body_bytes is None or args.max_request_body_bytes < 1024:
        raise HomelabError(f"--max-request-body-bytes must be at least 1024 (e.g. 32MiB), "
                           f"got {args.max_request_body_bytes}")
    if args.max_seqs_per_request < 1:
        raise HomelabError(f"--max-seqs-per-request must be >= 1, got {args.max_seqs_per_request}")
    api_key = resolve_api_key(args.api_key, args.api_key_file)
    compat = vllm_flags.resolve(args)
    engine_args = EngineArgs.from_cli(args)  # validates; errors are one-line HomelabErrors
    if engine_args.node_rank > 0:
        # Another node of a multi-node TP group: run this node's ranks, no HTTP server.
        from homelab_llm.engine.parallel import serve_worker_node

        logging.getLogger("homelab_llm.server").info(
            "node %d of %d: serving ranks for %s:%d", engine_args.node_rank, engine_args.nnodes,
            engine_args.master_addr, engine_args.master_port)
        return serve_worker_node(engine_args)

    from homelab_llm.engine.model.context_limit import check_max_model_len
    from homelab_llm.engine.model.loader import load_model_config
    from homelab_llm.server.app import build_app
    from homelab_llm.server.launch import ServeError, bind_socket, serve
    from homelab_llm.server.state import ServerConfig

    log = logging.getLogger("homelab_llm.server")
    sock = bind_socket(args.host, args.port)  # before the model: a busy port fails at once
    # A context the model cannot address is one line and exit 2, before the weights load.
    try:
        model_config = load_model_config(args.model, engine_args.load_format,
                                         engine_args.hf_overrides)
    except HomelabError as err:
        raise ServeError(f"the model failed to load: {err}") from err
    check_max_model_len(engine_args.max_model_len, model_config)
    if (warning := exposure_warning(args.host, api_key is not None)) is not None:
        log.warning("%s", warning)
    names = tuple(args.served_model_name or [Path(args.model).stem])
    config = ServerConfig(served_model_names=names, model_path=args.model, api_key=api_key,
                          max_queue_len=args.max_queue_len, drain_timeout_s=args.drain_timeout,
                          host=args.host,
                          allowed_hosts=tuple(h.strip() for h in args.allowed_hosts.split(",")
                                              if h.strip()),
                          max_request_body_bytes=args.max_request_body_bytes,
                          max_seqs_per_request=args.max_seqs_per_request,
                          reasoning_parser=compat.reasoning_parser,
                          max_logprobs=compat.max_logprobs,
                          tool_call_parser=compat.tool_call_parser)

    log.info("loading %s", args.model)
    # A partial of a module-level function: it pickles, so it can run in the engine process.
    factory = functools.partial(load_engine, engine_args, compat.chat_template)
    app = build_app(config, factory, engine_process=not args.engine_in_process)
    return serve(app, args.host, args.port, args.uvicorn_log_level, sock=sock)


def load_engine(engine_args: EngineArgs, chat_template: str | None) -> Engine:
    from homelab_llm.engine.core import LLMEngine

    engine = LLMEngine(engine_args)
    if chat_template is not None and engine.tokenizer is not None:
        engine.tokenizer.chat_template = chat_template  # vLLM's --chat-template
    return engine


def resolve_api_key(flag: str | None, path: str | None) -> str | None:
    """--api-key, else the first line of --api-key-file, else $HOMELAB_LLM_API_KEY, else None."""
    if flag and path:
        raise HomelabError("give one of --api-key and --api-key-file, not both")
    if path:
        try:
            key = Path(path).expanduser().read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise HomelabError(f"--api-key-file {path}: cannot read it ({err})") from err
        if not key or not key[0].strip():
            raise HomelabError(f"--api-key-file {path}: the file is empty; write the key on "
                               f"its first line")
        return key[0].strip()
    return flag or os.environ.get(API_KEY_ENV) or None
