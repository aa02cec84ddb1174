"""This machine's CPU and RAM, and the service child's own CPU and resident memory (psutil).

The child's figures add up the whole process tree (TP workers, a tokenizer pool), since that is
what the service costs. psutil measures CPU between two calls on the same Process object, so
those objects are kept from one read to the next; the first read of a process says 0%.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class HostReading:
    cpu_pct: float | None = None  # all cores together, 0-100
    ram_used: int | None = None
    ram_total: int | None = None
    child_cpu_pct: float | None = None  # may exceed 100 (several cores)
    child_rss: int | None = None


class HostReader:
    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}
        psutil.cpu_percent(interval=None)  # primes the system-wide counter

    def read(self, child_pid: int | None) -> HostReading:
        memory = psutil.virtual_memory()
        cpu, rss = self._child(child_pid) if child_pid else (None, None)
        return HostReading(psutil.cpu_percent(interval=None), memory.total - memory.available,
                           memory.total, cpu, rss)

    def _child(self, pid: int) -> tuple[float | None, int | None]:
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return None, None
        cpu, rss = 0.0, 0
        alive: dict[int, psutil.Process] = {}
        for proc in tree:
            kept = self._procs.get(proc.pid, proc)
            try:
                cpu += kept.cpu_percent(interval=None)
                rss += kept.memory_info().rss
            except psutil.Error:
                continue
            alive[proc.pid] = kept
        self._procs = alive
        return cpu, rss
