"""One pid file per running service, so a later app can find a child an earlier one left behind.

A record says which preset runs as which process (pid, its create time, so a reused pid is never
mistaken for ours), on which port, started by which app. At start the app lists the records whose
process still runs the same argv while the app that wrote them is gone: those are orphans, offered
for adoption or stopping. Records of dead processes are removed as they are found.

The folder: $HOMELAB_LLM_STATE_DIR, else the platform's user state folder (~/.local/state/homelab-llm).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import platformdirs
import psutil

STATE_DIR_ENV = "HOMELAB_LLM_STATE_DIR"


def state_dir() -> Path:
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV])
    return platformdirs.user_state_path("homelab-llm")


@dataclass(frozen=True)
class ServiceRecord:
    preset: str
    pid: int
    create_time: float  # psutil's, to tell our process from a later one with the same pid
    host: str
    port: int
    url: str
    argv: tuple[str, ...]
    app_pid: int  # the app that started it

    def alive(self) -> bool:
        """The recorded process still runs, and is the one we started."""
        try:
            proc = psutil.Process(self.pid)
            return (abs(proc.create_time() - self.create_time) < 1.0
                    and proc.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False


class PidFiles:
    def __init__(self, folder: Path | None = None) -> None:
        self.folder = (folder or state_dir()) / "services"

    def path(self, preset: str) -> Path:
        return self.folder / f"{preset}.json"

    def log_path(self, preset: str) -> Path:
        """The service's stdout and stderr (the app tails it; it outlives the app)."""
        return self.folder.parent / "logs" / f"{preset}.log"

    def write(self, preset: str, pid: int, host: str, port: int, url: str,
              argv: list[str]) -> ServiceRecord | None:
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            return None  # already gone: nothing to find later
        record = ServiceRecord(preset, pid, created, host, port, url, tuple(argv), os.getpid())
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path(preset).with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(record)))
        tmp.replace(self.path(preset))  # a reader never sees half a record
        return record

    def remove(self, preset: str, pid: int | None = None) -> None:
        """Forget `preset`'s record (only when it is still about `pid`, if given)."""
        path = self.path(preset)
        record = _read(path)
        if record is not None and pid is not None and record.pid != pid:
            return
        path.unlink(missing_ok=True)

    def orphans(self) -> list[ServiceRecord]:
        """Records whose service still runs while the app that started it is gone."""
        found = []
        for path in sorted(self.folder.glob("*.json")) if self.folder.is_dir() else []:
            record = _read(path)
            if record is None or not record.alive():
                path.unlink(missing_ok=True)
                continue
            if record.app_pid != os.getpid() and not psutil.pid_exists(record.app_pid):
                found.append(record)
        return found


def _read(path: Path) -> ServiceRecord | None:
    try:
        data = json.loads(path.read_text())
        data["argv"] = tuple(data["argv"])
        return ServiceRecord(**data)
    except (OSError, ValueError, TypeError, KeyError):
        return None
