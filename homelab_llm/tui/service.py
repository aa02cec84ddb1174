"""The engine as a managed child service: start a preset in its own process group, stream its
output, wait for health, stop it (SIGTERM, then SIGKILL after a grace period), notice a crash.

UI-free on purpose: the app subscribes to events and marshals them onto its own thread, and the
tests drive this class directly. Every child started here is registered in one process-wide set
so that an atexit hook can kill whatever is still alive however the app ends.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import enum
import os
import shlex
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from homelab_llm.errors import HomelabError
from homelab_llm.presets import Preset
from homelab_llm.tui.adopted import AdoptedProcess
from homelab_llm.tui.failure import first_error_line, this_run
from homelab_llm.tui.pidfiles import PidFiles, ServiceRecord
from homelab_llm.tui.process_group import check_port_free, kill_group, terminate_group
from homelab_llm.tui.launch import launch_command, launch_env

LOG_LINES_KEPT = 5000
LAST_LINES_ON_CRASH = 12
LINES_SEARCHED_FOR_REASON = 400
FOLLOW_INTERVAL_S = 0.05  # how often the log file is checked for new output
ADOPTED_TAIL_BYTES = 16384


class ServiceError(HomelabError):
    """The service cannot be started as asked (busy port, already running, missing program)."""


class ServiceState(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"  # child running, /health not answering yet
    HEALTHY = "healthy"
    STOPPING = "stopping"
    CRASHED = "crashed"  # exited on its own, or never became healthy


@dataclass(frozen=True)
class ServiceStatus:
    state: ServiceState = ServiceState.STOPPED
    preset: str = ""
    pid: int | None = None
    url: str = ""
    started_at: float | None = None  # monotonic clock
    ready_after_s: float | None = None  # seconds from start to first healthy answer
    exit_code: int | None = None
    message: str = ""
    last_lines: tuple[str, ...] = ()
    reason: str = ""  # the child's first error line after a crash (failure.first_error_line)
    load_progress: float | None = None  # 0..1 from /health's 503 "loading" answer, if it says
    load_phase: str = ""

    @property
    def running(self) -> bool:
        return self.state in (ServiceState.STARTING, ServiceState.HEALTHY, ServiceState.STOPPING)


@dataclass(frozen=True)
class LogLine:
    text: str


@dataclass(frozen=True)
class StateChanged:
    status: ServiceStatus


ServiceEvent = LogLine | StateChanged


@dataclass
class _Child:
    proc: subprocess.Popen[str]  # or an AdoptedProcess, which answers the same calls
    preset: Preset
    url: str
    started_at: float
    log_path: Path
    adopted: bool = False
    stopping: threading.Event = field(default_factory=threading.Event)


class ServiceManager:
    """One child service at a time. Thread-safe: the UI calls start/stop from workers."""

    def __init__(self, *, grace_s: float = 10.0, health_interval_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic,
                 pidfiles: PidFiles | None = None) -> None:
        """pidfiles: where running services and their logs are kept (None: a private temporary
        folder, removed with the manager, so tests and embedded uses never see each other's
        services)."""
        self.grace_s = grace_s
        self._scratch: tempfile.TemporaryDirectory[str] | None = None
        if pidfiles is None:  # removed with the manager or at exit (tests start hundreds)
            self._scratch = tempfile.TemporaryDirectory(prefix="homelab-llm-")
            pidfiles = PidFiles(Path(self._scratch.name))
        self.pidfiles = pidfiles
        self.health_interval_s = health_interval_s
        self.clock = clock
        self.logs: collections.deque[str] = collections.deque(maxlen=LOG_LINES_KEPT)
        self._status = ServiceStatus()
        self._child: _Child | None = None
        self._lock = threading.RLock()
        self._listeners: list[Callable[[ServiceEvent], None]] = []
        _LIVE_MANAGERS.add(self)

    # ---------------------------------------------------------------- observing

    @property
    def status(self) -> ServiceStatus:
        return self._status

    def subscribe(self, listener: Callable[[ServiceEvent], None]) -> None:
        """listener runs on the manager's threads; a UI must hop to its own thread itself."""
        self._listeners.append(listener)

    def _emit(self, event: ServiceEvent) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # a broken listener must not kill the reader thread (and lose logs)
                pass

    def _set(self, **changes: object) -> None:
        with self._lock:
            self._status = dataclasses.replace(self._status, **changes)  # type: ignore[arg-type]
            status = self._status
        self._emit(StateChanged(status))

    def _log(self, text: str) -> None:
        self.logs.append(text)
        self._emit(LogLine(text))

    # ---------------------------------------------------------------- control

    def start(self, preset: Preset, port: int | None = None) -> ServiceStatus:
        """Start `preset`; returns at once (health is awaited on a background thread)."""
        port = preset.port if port is None else port
        with self._lock:
            self._refuse_if_running()
            check_port_free(preset.host, port)
            argv = launch_command(preset, port)
            self._log(f"$ {shlex.join(argv)}")
            log_path = self.pidfiles.log_path(preset.name)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            # Output goes to a file, not a pipe: a pipe breaks when the app dies and takes a
            # printing server with it, and a later app tails the same file after adopting it.
            try:
                with open(log_path, "wb") as log:
                    proc = subprocess.Popen(
                        argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        env=launch_env(preset), start_new_session=True)  # own group: killpg reaches workers
            except OSError as err:
                raise ServiceError(f"cannot start {argv[0]!r} for preset {preset.name!r}: "
                                   f"{err.strerror or err}") from err
            child = _Child(proc, preset, _url(preset.host, port), self.clock(), log_path)  # type: ignore[arg-type]
            self.pidfiles.write(preset.name, proc.pid, preset.host, port, child.url, argv)
            self._watch(child, f"starting {preset.name}")
        return self._status

    def adopt(self, record: ServiceRecord, preset: Preset) -> ServiceStatus:
        """Take over a service an earlier app left running (see pidfiles): from now on it is
        watched, health-checked and stopped like one started here, minus its output."""
        with self._lock:
            self._refuse_if_running()
            if not record.alive():
                raise ServiceError(f"process {record.pid} of {record.preset!r} is gone already")
            self._log(f"$ # adopted {record.preset} (pid {record.pid}) left by an earlier app")
            preset = dataclasses.replace(preset, port=record.port, host=record.host)
            child = _Child(AdoptedProcess(record.pid), preset, record.url,  # type: ignore[arg-type]
                           self.clock(), self.pidfiles.log_path(preset.name), adopted=True)
            self.pidfiles.write(preset.name, record.pid, record.host, record.port, record.url,
                                list(record.argv))
            self._watch(child, f"adopted {preset.name} (pid {record.pid})")
        return self._status

    def _refuse_if_running(self) -> None:
        if self._status.running:
            raise ServiceError(
                f"{self._status.preset!r} is already {self._status.state.value}; stop it first")

    def _watch(self, child: _Child, message: str) -> None:
        """Make `child` the service and start its reader, exit and health threads."""
        self._child = child
        self._set(state=ServiceState.STARTING, preset=child.preset.name, pid=child.proc.pid,
                  url=child.url, started_at=child.started_at, ready_after_s=None, exit_code=None,
                  message=message, last_lines=(), reason="")
        reader = threading.Thread(target=self._read_output, args=(child,), name="service-output",
                                  daemon=True)
        reader.start()
        threading.Thread(target=self._watch_exit, args=(child, reader), name="service-exit",
                         daemon=True).start()
        threading.Thread(target=self._wait_healthy, args=(child,), name="service-health",
                         daemon=True).start()

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the whole group, SIGKILL what is left after the grace period; returns the exit
        code (None when nothing ran). Blocks up to grace_s plus a moment: call it off the UI thread."""
        with self._lock:
            child = self._child
            if child is None or child.stopping.is_set():
                return self._status.exit_code
            child.stopping.set()
            if child.proc.poll() is None:
                self._set(state=ServiceState.STOPPING, message=f"stopping {child.preset.name}")
        code = terminate_group(child.proc, self.grace_s if grace_s is None else grace_s)
        self._forget(child)
        with self._lock:
            if self._child is child:
                self._child = None
                self._set(state=ServiceState.STOPPED, pid=None, exit_code=code,
                          message=f"{child.preset.name} stopped (exit code {code})")
        return code

    def shutdown(self) -> None:
        """Used when the app ends: a short grace, never an orphan."""
        self.stop(grace_s=min(self.grace_s, 3.0))

    def kill_now(self) -> None:
        """The last resort of a bounded exit: SIGKILL the child's group without waiting."""
        child = self._child
        if child is not None:
            kill_group(child.proc.pid)
            self._forget(child)

    def _crash_lines(self) -> dict[str, object]:
        lines = this_run(list(self.logs)[-LINES_SEARCHED_FOR_REASON:])
        return {"last_lines": tuple(lines[-LAST_LINES_ON_CRASH:]), "reason": first_error_line(lines)}

    # ---------------------------------------------------------------- threads

    def _note_loading(self, child: _Child, response: httpx.Response) -> None:
        """Our server answers 503 {"status": "loading", "progress", "phase"} while it loads."""
        try:
            body = response.json()
            progress = float(body["progress"])
            phase = str(body.get("phase", "loading"))
        except (ValueError, KeyError, TypeError):
            return  # another server, or no progress to tell
        with self._lock:
            if self._child is not child or child.stopping.is_set():
                return
            if (progress, phase) != (self._status.load_progress, self._status.load_phase):
                self._set(load_progress=min(max(progress, 0.0), 1.0), load_phase=phase)

    def _forget(self, child: _Child) -> None:
        self.pidfiles.remove(child.preset.name, child.proc.pid)

    def _read_output(self, child: _Child) -> None:
        """Follow the child's log file until the child is gone and the file is drained."""
        try:
            log = open(child.log_path, "rb")
        except OSError:
            return
        with log:
            if child.adopted:  # show the tail of what it said before we came
                log.seek(max(0, log.seek(0, os.SEEK_END) - ADOPTED_TAIL_BYTES))
                log.readline()  # most likely half a line
            pending = b""
            while True:
                chunk = log.readline()
                if chunk:
                    pending += chunk
                    if pending.endswith(b"\n"):
                        self._log(pending.decode("utf-8", "replace").rstrip("\r\n"))
                        pending = b""
                    continue
                if child.proc.poll() is not None:
                    break
                time.sleep(FOLLOW_INTERVAL_S)
            if pending:
                self._log(pending.decode("utf-8", "replace").rstrip("\r\n"))

    def _watch_exit(self, child: _Child, reader: threading.Thread) -> None:
        # Waits on the process, not on EOF: a worker that inherited the pipe could keep it open
        # long after the leader died, and a crash must be seen at once.
        code = child.proc.wait()
        if child.stopping.is_set():
            return  # stop() reports the exit
        with self._lock:
            if self._child is not child:
                return
            self._child = None
        kill_group(child.proc.pid)  # the leader died; take any workers it left with it
        self._forget(child)
        reader.join(timeout=2.0)  # so the last lines shown include the child's final words
        self._set(state=ServiceState.CRASHED, pid=None, exit_code=code, **self._crash_lines(),
                  message=f"{child.preset.name} exited with code {code}")

    def _wait_healthy(self, child: _Child) -> None:
        url = child.url + child.preset.health_path
        deadline = child.started_at + child.preset.startup_timeout
        with httpx.Client(timeout=2.0) as client:
            while child.proc.poll() is None and not child.stopping.is_set():
                try:
                    response = client.get(url)
                    if response.status_code != 200:
                        self._note_loading(child, response)
                    if response.status_code == 200:
                        elapsed = self.clock() - child.started_at
                        with self._lock:
                            if self._child is child and not child.stopping.is_set():
                                self._set(state=ServiceState.HEALTHY, ready_after_s=elapsed,
                                          message=f"{child.preset.name} healthy after {elapsed:.1f} s")
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                if self.clock() > deadline:
                    self._log(f"[homelab-llm] no healthy answer from {url} within "
                              f"{child.preset.startup_timeout:g} s; stopping")
                    self.stop()
                    self._set(state=ServiceState.CRASHED, exit_code=child.proc.returncode,
                              **self._crash_lines(), message=f"{child.preset.name} not healthy after "
                                      f"{child.preset.startup_timeout:g} s")
                    return
                time.sleep(self.health_interval_s)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# Every manager alive in this process. The one piece of module state, because atexit needs to
# find children when the app dies from an exception before its own cleanup runs.
_LIVE_MANAGERS: weakref.WeakSet[ServiceManager] = weakref.WeakSet()


def stop_orphan(record: ServiceRecord, grace_s: float = 10.0,
                pidfiles: PidFiles | None = None) -> int | None:
    """Stop a service an earlier app left running (SIGTERM its group, SIGKILL after grace_s)."""
    code = terminate_group(AdoptedProcess(record.pid), grace_s)  # type: ignore[arg-type]
    if pidfiles is not None:
        pidfiles.remove(record.preset, record.pid)
    return code


def kill_all_now() -> None:
    for manager in list(_LIVE_MANAGERS):
        manager.kill_now()


def shutdown_all() -> None:
    for manager in list(_LIVE_MANAGERS):
        manager.shutdown()


atexit.register(shutdown_all)
