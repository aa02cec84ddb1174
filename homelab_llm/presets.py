"""Service presets: one TOML file each, built-ins in assets/presets, user ones in the platform
config dir overriding built-ins by name.

A preset says how to start one inference server (ours, vLLM, SGLang, llama.cpp's, or any
command) and how to tell it is up. The `args` table is passed through as `--flag value` in the
backend's own spelling (vLLM's for `builtin` and `vllm`), so a preset reads like the command
line a user would type. Validation returns every problem with the field it belongs to, so the
TUI editor can show each one next to its input and refuse to write the file.
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, get_args

from homelab_llm.errors import HomelabError

Backend = Literal["builtin", "vllm", "sglang", "llama.cpp", "command"]
BACKENDS: tuple[str, ...] = get_args(Backend)
# A table value is a JSON flag's object (vLLM's --speculative-config): passed on as JSON text.
ArgValue = str | int | float | bool | dict

DEFAULT_MODEL = "@default"  # the embedded SmolLM2 GGUF, resolved at launch (assets.default_model_path)
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
FLAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
PRESETS_DIR_ENV = "HOMELAB_LLM_PRESETS_DIR"  # lets tests and `serve --preset` children share a dir
API_KEY_ENV = "HOMELAB_LLM_API_KEY"  # our server's key; a preset sets it in its env table
KNOWN_KEYS = frozenset({"name", "description", "backend", "model", "host", "port", "health_path",
                        "startup_timeout", "command", "args", "env", "routable", "ttl"})


class PresetError(HomelabError, ValueError):
    """A preset that cannot be found, read or used; the message names the file and the field."""


@dataclass(frozen=True)
class PresetIssue:
    field: str  # "port", "args.max_num_seqs", "name", ...; "" for the file as a whole
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


@dataclass(frozen=True)
class Preset:
    name: str
    backend: Backend = "builtin"
    model: str = ""
    description: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    health_path: str = "/health"
    startup_timeout: float = 600.0  # seconds to wait for health: a 27B load from disk is minutes
    command: tuple[str, ...] = ()  # backend = "command": argv with {python} {port} {host} {model}
    args: dict[str, ArgValue] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    routable: bool = True  # listed by `homelab-llm router` and started there on demand
    ttl: float = 0.0  # router: seconds idle before unloading; 0 = the router's --ttl
    source: Path | None = field(default=None, compare=False)  # where it was read from
    builtin: bool = field(default=False, compare=False)

    def validate(self) -> list[PresetIssue]:
        return validate_preset(self)

    def resolved_model(self) -> str:
        """The model as the server should see it: @default -> the embedded GGUF, ~ expanded."""
        if self.model == DEFAULT_MODEL:
            from homelab_llm.assets import default_model_path

            try:
                return str(default_model_path())
            except FileNotFoundError as err:
                raise PresetError(f"preset {self.name!r}: {err}") from err
        return os.path.expanduser(self.model)

    def to_cli_args(self) -> list[str]:
        """The model first, then `--flag value` per args entry (true -> --flag, false -> --no-flag).

        Host and port are not included: the service manager decides the port it launches on.
        """
        return ([self.resolved_model()] if self.model else []) + self.flag_args()

    def flag_args(self) -> list[str]:
        """Just the args table as flags, for backends that take the model as a flag (-m, --model-path)."""
        out: list[str] = []
        for key, value in self.args.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                out.append(flag)
            elif value is False:
                out.append("--no-" + flag[2:])
            elif isinstance(value, dict):
                out += [flag, json.dumps(value)]
            else:
                out += [flag, str(value)]
        return out

    def with_changes(self, **changes: object) -> Preset:
        return replace(self, **changes)  # type: ignore[arg-type]

    def exposure_warning(self) -> str | None:
        """For our own server: a warning when it would listen beyond this machine without a key
        (the key comes from the env table or the environment the launcher passes on)."""
        if self.backend != "builtin":
            return None
        has_key = bool(self.env.get(API_KEY_ENV) or os.environ.get(API_KEY_ENV))
        return exposure_warning(self.host, has_key)


def exposure_warning(host: str, has_api_key: bool) -> str | None:
    """The warning for serving on a non-loopback address without an API key; None when fine."""
    from homelab_llm.server.hosts import is_loopback_host

    if has_api_key or is_loopback_host(host):
        return None
    return (f"serving on {host}, which is not a loopback address, without an API key: anyone who "
            f"reaches this port can use the model; set ${API_KEY_ENV} or --api-key-file")


def validate_preset(preset: Preset) -> list[PresetIssue]:
    issues: list[PresetIssue] = []

    def bad(where: str, message: str) -> None:
        issues.append(PresetIssue(where, message))

    if not NAME_RE.match(preset.name):
        bad("name", "use 1-64 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit")
    if preset.backend not in BACKENDS:
        bad("backend", f"{preset.backend!r} is not one of {', '.join(BACKENDS)}")
    if preset.backend == "command":
        if not preset.command or not all(isinstance(a, str) and a for a in preset.command):
            bad("command", "a command preset needs a non-empty list of strings, e.g. [\"{python}\", \"app.py\"]")
    elif not preset.model.strip():
        bad("model", "give a model path (GGUF file, HF folder or model name), or @default")
    if isinstance(preset.port, bool) or not isinstance(preset.port, int) or not 1 <= preset.port <= 65535:
        bad("port", f"must be an integer 1-65535, got {preset.port!r}")
    if not preset.host.strip():
        bad("host", "must not be empty")
    if not preset.health_path.startswith("/"):
        bad("health_path", f"must start with '/', got {preset.health_path!r}")
    timeout = preset.startup_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            math.isfinite(timeout) and timeout > 0):
        bad("startup_timeout", f"must be a positive number of seconds, got {timeout!r}")
    if not isinstance(preset.routable, bool):
        bad("routable", f"must be true or false, got {preset.routable!r}")
    ttl = preset.ttl
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not (math.isfinite(ttl) and ttl >= 0):
        bad("ttl", f"must be a number of seconds >= 0 (0: the router's default), got {ttl!r}")
    for key, value in preset.args.items():
        if not FLAG_RE.match(key):
            bad(f"args.{key}", "flag names use letters, digits, '_' and '-'")
        elif isinstance(value, float) and not math.isfinite(value):
            bad(f"args.{key}", "must be a finite number")
        elif isinstance(value, dict):
            if not all(isinstance(v, str | int | float | bool) for v in value.values()):
                bad(f"args.{key}", "a table's values must be strings, numbers or booleans")
        elif not isinstance(value, str | int | float | bool):
            bad(f"args.{key}", f"must be a string, number, boolean or table, got {type(value).__name__}")
    for key, value in preset.env.items():
        if not key or "=" in key or not isinstance(value, str):
            bad(f"env.{key}", "environment entries are NAME = \"string\"")
    if preset.backend == "builtin" and not any(i.field.startswith("args.") for i in issues):
        issues += _validate_engine_args(preset.args)
    return issues


def _validate_engine_args(args: dict[str, ArgValue]) -> list[PresetIssue]:
    """Our own engine: the same checks `serve` would make, so a bad value never reaches a child."""
    import dataclasses

    from homelab_llm.engine.args import EngineArgs, parse_bytes

    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    fields.pop("model")
    defaults = EngineArgs()
    values: dict[str, object] = {}
    issues: list[PresetIssue] = []
    for key, value in args.items():
        name = key.replace("-", "_")
        if name not in fields:
            issues.append(PresetIssue(f"args.{key}", "not an engine flag (see `homelab-llm serve --help`)"))
            continue
        default = getattr(defaults, name)
        optional_ints = ("max_model_len", "max_state_snapshots")
        want = type(default) if default is not None else int if name in optional_ints else str
        if name in ("kv_cache_memory_bytes", "state_snapshot_memory_bytes"):
            try:
                values[name] = parse_bytes(value)  # type: ignore[arg-type]
            except HomelabError as err:
                issues.append(PresetIssue(f"args.{key}", str(err)))
            continue
        if isinstance(value, dict):
            if want is not str:
                issues.append(PresetIssue(f"args.{key}", f"must not be a table, got {value!r}"))
            else:
                values[name] = json.dumps(value)  # a JSON flag, e.g. speculative_config
        elif want is bool and not isinstance(value, bool):
            issues.append(PresetIssue(f"args.{key}", "must be true or false"))
        elif want is int and (isinstance(value, bool) or not isinstance(value, int)):
            issues.append(PresetIssue(f"args.{key}", f"must be an integer, got {value!r}"))
        elif want is float and (isinstance(value, bool) or not isinstance(value, int | float)):
            issues.append(PresetIssue(f"args.{key}", f"must be a number, got {value!r}"))
        else:
            values[name] = value
    if issues:
        return issues
    try:
        EngineArgs(**values).validate()  # type: ignore[arg-type]
    except HomelabError as err:
        flag = re.search(r"--([a-z-]+)", str(err))
        where = f"args.{flag.group(1).replace('-', '_')}" if flag else "args"
        issues.append(PresetIssue(where, str(err)))
    return issues


# --------------------------------------------------------------------------- files


def builtin_presets_dir() -> Path:
    from homelab_llm.assets import assets_dir

    return assets_dir() / "presets"


def user_presets_dir() -> Path:
    override = os.environ.get(PRESETS_DIR_ENV)
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_config_dir("homelab-llm")) / "presets"


def parse_preset(data: dict[str, object], *, name: str, source: Path | None = None,
                 builtin: bool = False) -> tuple[Preset, list[PresetIssue]]:
    """TOML table -> Preset plus every problem found (unknown keys, wrong types, bad values)."""
    issues = [PresetIssue(k, "unknown key") for k in data if k not in KNOWN_KEYS]
    kwargs: dict[str, object] = {"name": name, "source": source, "builtin": builtin}
    for key, want in (("description", str), ("backend", str), ("model", str), ("host", str),
                      ("health_path", str), ("name", str)):
        if key in data:
            if isinstance(data[key], want):
                kwargs[key] = data[key]
            else:
                issues.append(PresetIssue(key, f"must be a string, got {data[key]!r}"))
    for key in ("port", "startup_timeout", "routable", "ttl"):
        if key in data:
            kwargs[key] = data[key]  # range and type checked by validate_preset
    for key in ("args", "env"):
        if key in data:
            if isinstance(data[key], dict):
                kwargs[key] = dict(data[key])  # type: ignore[arg-type]
            else:
                issues.append(PresetIssue(key, "must be a table"))
    if "command" in data:
        cmd = data["command"]
        if isinstance(cmd, list) and all(isinstance(a, str) for a in cmd):
            kwargs["command"] = tuple(cmd)
        else:
            issues.append(PresetIssue("command", "must be a list of strings"))
    preset = Preset(**kwargs)  # type: ignore[arg-type]
    if source is not None and preset.name != source.stem:
        issues.append(PresetIssue("name", f"{preset.name!r} does not match the file name {source.name}"))
    return preset, issues + preset.validate()


def read_preset_file(path: Path, *, builtin: bool = False) -> Preset:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise PresetError(f"cannot read preset {path}: {err}") from err
    except tomllib.TOMLDecodeError as err:
        raise PresetError(f"preset {path} is not valid TOML: {err}") from err
    preset, issues = parse_preset(data, name=path.stem, source=path, builtin=builtin)
    if issues:
        raise PresetError(f"preset {path}: " + "; ".join(map(str, issues)))
    return preset


def _scan(directory: Path, builtin: bool) -> tuple[dict[str, Preset], dict[Path, str]]:
    found: dict[str, Preset] = {}
    broken: dict[Path, str] = {}
    if directory.is_dir():
        for path in sorted(directory.glob("*.toml")):
            try:
                found[path.stem] = read_preset_file(path, builtin=builtin)
            except PresetError as err:
                broken[path] = str(err)
    return found, broken


@dataclass(frozen=True)
class PresetScan:
    presets: list[Preset]  # usable ones, user files replacing built-ins by name, sorted by name
    broken: dict[Path, str]  # file -> why it cannot be used; shown, never silently dropped


def scan_presets() -> PresetScan:
    builtins, broken_b = _scan(builtin_presets_dir(), builtin=True)
    users, broken_u = _scan(user_presets_dir(), builtin=False)
    merged = sorted({**builtins, **users}.values(), key=lambda p: p.name)
    return PresetScan(merged, {**broken_b, **broken_u})


def list_presets() -> list[Preset]:
    """Every usable preset; a broken user file never hides the others (see scan_presets)."""
    return scan_presets().presets


def load_preset(name: str) -> Preset:
    """The preset called `name` (user file first), or a PresetError naming the ones there are."""
    for directory, builtin in ((user_presets_dir(), False), (builtin_presets_dir(), True)):
        path = directory / f"{name}.toml"
        if NAME_RE.match(name) and path.is_file():
            return read_preset_file(path, builtin=builtin)
    known = ", ".join(p.name for p in list_presets()) or "none"
    raise PresetError(f"no preset named {name!r} (known: {known})")


def save_preset(preset: Preset) -> Path:
    """Write a user preset atomically; refuses (PresetError) when it does not validate."""
    issues = preset.validate()
    if issues:
        raise PresetError(f"preset {preset.name!r} not saved: " + "; ".join(map(str, issues)))
    directory = user_presets_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{preset.name}.toml"
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(dump_preset(preset), encoding="utf-8")
    os.replace(tmp, path)  # never a half-written preset, even if the app dies mid-save
    return path


def delete_preset(name: str) -> Path:
    """Delete the user file; a built-in of the same name then shows again. Built-ins stay."""
    path = user_presets_dir() / f"{name}.toml"
    if not NAME_RE.match(name) or not path.is_file():
        raise PresetError(f"{name!r} is not a user preset (built-in presets cannot be deleted)")
    path.unlink()
    return path


def dump_preset(preset: Preset) -> str:
    """Preset -> TOML text. Presets are flat (scalars plus two tables), so a small writer does."""
    lines = [f"name = {_toml_value(preset.name)}"]
    if preset.description:
        lines.append(f"description = {_toml_value(preset.description)}")
    lines.append(f"backend = {_toml_value(preset.backend)}")
    if preset.model:
        lines.append(f"model = {_toml_value(preset.model)}")
    if preset.command:
        lines.append(f"command = [{', '.join(_toml_value(a) for a in preset.command)}]")
    lines += [f"host = {_toml_value(preset.host)}", f"port = {preset.port}",
              f"health_path = {_toml_value(preset.health_path)}",
              f"startup_timeout = {_toml_value(preset.startup_timeout)}"]
    if not preset.routable:
        lines.append("routable = false")
    if preset.ttl:
        lines.append(f"ttl = {_toml_value(preset.ttl)}")
    for table in ("args", "env"):
        entries: dict[str, ArgValue] = getattr(preset, table)
        if entries:
            lines += ["", f"[{table}]"]
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in entries.items()]
    return "\n".join(lines) + "\n"


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_value(key)


def _toml_value(value: ArgValue) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    escaped = (value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
               .replace("\t", "\\t").replace("\r", "\\r"))
    escaped = re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]", lambda m: f"\\u{ord(m.group()):04x}", escaped)
    return f'"{escaped}"'
