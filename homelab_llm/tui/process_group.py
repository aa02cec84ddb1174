"""Processes in their own group: is a port free, is a group alive, and stopping a whole group
(SIGTERM, a grace period, SIGKILL for what is left, reaping the leader). The service manager
uses these for its children; the app uses terminate_group through stop_orphan for services an
earlier app left behind (see pidfiles)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

from homelab_llm.errors import HomelabError


class PortBusyError(HomelabError):
    """Someone already listens on the port a service would take."""


def check_port_free(host: str, port: int) -> None:
    """Refuse a port someone already listens on, before starting a child that would fail late.

    SO_REUSEADDR matches what uvicorn and the other servers set, so a port in TIME_WAIT from our
    own last run is not reported as busy.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise PortBusyError(
                f"port {port} on {host} is already in use ({err.strerror}); stop whatever listens "
                f"there or give the preset another port") from err


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else (cannot be ours, but it is alive)
        return True
    return True


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def terminate_group(proc: subprocess.Popen[str], grace_s: float) -> int | None:
    """SIGTERM the group, wait until the leader and every member are gone, SIGKILL stragglers."""
    pgid = proc.pid  # start_new_session makes the child its group's leader
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, or it lingers as a zombie member of the group
        if proc.returncode is not None and not process_group_alive(pgid):
            return proc.returncode
        time.sleep(0.05)
    kill_group(pgid)
    try:
        code: int | None = proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:  # unkillable (D state); nothing more a user process can do
        code = None
    # Members die asynchronously after SIGKILL and are reaped by init once orphaned; wait for
    # that so "stopped" means the group is really gone.
    deadline = time.monotonic() + 3.0
    while process_group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return code
