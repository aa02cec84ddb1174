"""Reads from sysfs that never raise: a missing file, garbage, or EACCES all read as None.

Every path is taken relative to a root ("/" on a real machine, a fixture tree in tests), so the
whole hardware walk can be pointed elsewhere with `--sysfs-root`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# Bus:device.function with the PCI domain, as sysfs names devices: 0000:03:00.0
BDF_RE = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
MAX_READ = 64 * 1024  # sysfs attributes are one page; refuse to slurp anything odd


def read_text(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_READ)
    except (OSError, ValueError):
        return None
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    return text or None


def read_int(path: Path, base: int = 10) -> int | None:
    """An integer attribute; '0x1002' is read with base 16 whatever `base` says."""
    text = read_text(path)
    if text is None:
        return None
    token = text.split()[0]
    try:
        return int(token, 16) if token.lower().startswith("0x") else int(token, base)
    except ValueError:
        return None


def read_keyvals(path: Path, sep: str = "=") -> dict[str, str]:
    """KEY=VALUE lines (uevent) or 'key value' lines (sep=' ', KFD properties)."""
    text = read_text(path)
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        key, found, value = line.strip().partition(sep)
        if found and key:
            out[key.strip()] = value.strip()
    return out


def list_dir(path: Path) -> list[str]:
    """Entries of a sysfs folder; dot entries are never sysfs (a fixture's .gitkeep, say)."""
    try:
        return sorted(name for name in os.listdir(path) if not name.startswith("."))
    except OSError:
        return []


def is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def normalize_bdf(address: str) -> str | None:
    """'00000000:01:00.0' (NVML) or '0000:01:00.0' -> '0000:01:00.0'; garbage -> None."""
    text = str(address).strip().lower()
    if not BDF_RE.match(text):
        return None
    domain, rest = text.split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"
