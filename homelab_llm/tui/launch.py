"""Preset -> argv and environment for the child process, one rule per backend."""

from __future__ import annotations

import os
import sys

from homelab_llm.parent_watch import PARENT_PID_ENV
from homelab_llm.presets import Preset, PresetError


def launch_command(preset: Preset, port: int | None = None, *,
                   resolve_model: bool = True) -> list[str]:
    """The argv that serves `preset` on host:port. resolve_model=False keeps `@default` and `~`
    as written (for display; resolving needs the model package installed)."""
    port = preset.port if port is None else port
    host = preset.host
    model = preset.resolved_model() if resolve_model else preset.model
    flags = preset.flag_args()
    listen = ["--host", host, "--port", str(port)]
    match preset.backend:
        case "builtin":
            return [sys.executable, "-m", "homelab_llm", "serve", model, *flags, *listen]
        case "vllm":
            return ["vllm", "serve", model, *flags, *listen]
        case "sglang":
            return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, *flags, *listen]
        case "llama.cpp":
            return ["llama-server", "--model", model, *flags, *listen]
        case "command":
            values = {"python": sys.executable, "port": str(port), "host": host, "model": model}
            try:
                return [arg.format(**values) for arg in preset.command]
            except (KeyError, IndexError, ValueError) as err:
                raise PresetError(
                    f"preset {preset.name!r}: command placeholder {err} is not one of "
                    "{python} {port} {host} {model} (write {{ and }} for literal braces)") from err
    raise PresetError(f"preset {preset.name!r}: unknown backend {preset.backend!r}")


def launch_env(preset: Preset) -> dict[str, str]:
    env = dict(os.environ)
    env.update(preset.env)
    env.setdefault("PYTHONUNBUFFERED", "1")  # so log lines reach the Logs screen as they happen
    env[PARENT_PID_ENV] = str(os.getpid())  # `serve` ends itself when the app is gone
    return env
