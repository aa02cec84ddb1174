"""The user's settings file: `config.toml` in the platform config dir (platformdirs), beside the
presets folder. Every key is optional; a missing file means the defaults.

    models_dirs = ["~/models", "/srv/llm"]   # scanned by `models` and the Models screen
    default_preset = "smollm2-cpu"           # what the router serves when a request names no model
    router_port = 8000                       # `homelab-llm router` without --port

HOMELAB_LLM_CONFIG names another file (tests, several setups). A bad file is a one-line error
naming the file and the key, never a traceback.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from homelab_llm.errors import HomelabError

CONFIG_ENV = "HOMELAB_LLM_CONFIG"
DEFAULT_ROUTER_PORT = 8000


class SettingsError(HomelabError, ValueError):
    """The settings file cannot be read or holds a bad value; the message names both."""


@dataclass(frozen=True)
class Settings:
    models_dirs: tuple[str, ...] = ()
    default_preset: str = ""
    router_port: int = DEFAULT_ROUTER_PORT


def settings_path() -> Path:
    override = os.environ.get(CONFIG_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_config_dir("homelab-llm")) / "config.toml"


def load_settings(path: Path | None = None) -> Settings:
    path = path or settings_path()
    if not path.is_file():
        return Settings()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise SettingsError(f"{path}: not a readable TOML file ({err})") from None
    unknown = sorted(set(data) - {"models_dirs", "default_preset", "router_port"})
    if unknown:
        raise SettingsError(f"{path}: unknown key {unknown[0]!r} (known: models_dirs, "
                            "default_preset, router_port)")
    dirs = data.get("models_dirs", [])
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        raise SettingsError(f"{path}: models_dirs must be a list of folder paths (strings)")
    preset = data.get("default_preset", "")
    if not isinstance(preset, str):
        raise SettingsError(f"{path}: default_preset must be a preset name (string)")
    port = data.get("router_port", DEFAULT_ROUTER_PORT)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise SettingsError(f"{path}: router_port must be an integer 1-65535, got {port!r}")
    return Settings(tuple(dirs), preset, port)
