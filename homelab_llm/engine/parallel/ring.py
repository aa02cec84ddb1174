"""The per-step plan's transport between the ranks of one node: a shared-memory ring.

One writer (rank 0) and N readers (the local worker ranks). The ring has `slots` fixed-size slots;
each holds a small header (sequence number, message length in int64 words) and int64 words. A
message (the PlanHeader words plus its flat payload) fills one slot, or several consecutive
slots when it is larger than one. The writer copies the words, then publishes the slot's sequence
number; a reader waits for the number it expects, copies the words out, then acknowledges. The
writer reuses a slot only after every reader acknowledged what it held.

Waiting spins (yielding the core) for SPIN_S, then sleeps in short naps, so a rank that waits
between decode steps wakes within microseconds and an idle server costs almost no CPU. While
waiting, both sides check that the other side lives: a reader raises ChannelClosed when the
writer's process is gone; the writer raises it when `peers_alive()` says a reader died.

Nothing is pickled: the words go through memory as int64. The backing file lives in /dev/shm and
is unlinked as soon as every reader has mapped it, so a crash never leaves it behind.
x86-64 and arm64 order the plain stores used here well enough for one writer: the sequence number
is written after the words (and on x86-64 stores are never reordered with earlier stores).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
import uuid
from typing import Callable

import torch

SPIN_S = 0.05  # spin this long before napping: longer than a decode step, shorter than idle
NAP_S = 5e-4  # longest nap once spinning stopped
CHECK_S = 0.1  # how often a waiting side checks that the other side lives
_LINE = 64  # one cache line per counter, so readers never share a line with the writer


class ChannelClosed(RuntimeError):
    """The other side of the channel died (or a wait ran out of time)."""


def shm_available() -> bool:
    return os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class ShmRing:
    """Broadcast ring in shared memory. Create with `ShmRing.create` in the writer and
    `ShmRing.attach(path, reader_index)` in each reader."""

    # control block: writer pid, readers, slots, slot words; then one ack line per reader
    def __init__(self, path: str, mm: mmap.mmap, reader: int | None) -> None:
        self.path, self._mm, self.reader = path, mm, reader
        head = (ctypes.c_int64 * 4).from_buffer(mm, 0)
        self.writer_pid, self.readers, self.slots, self.slot_words = (int(v) for v in head)
        del head
        self._acks = [ctypes.c_int64.from_buffer(mm, _LINE * (1 + r)) for r in range(self.readers)]
        base = _LINE * (1 + self.readers)
        stride = _LINE + 8 * self.slot_words
        self._seq = [ctypes.c_int64.from_buffer(mm, base + s * stride) for s in range(self.slots)]
        self._len = [ctypes.c_int64.from_buffer(mm, base + s * stride + 8)
                     for s in range(self.slots)]
        self._data = [torch.frombuffer(mm, dtype=torch.int64, count=self.slot_words,
                                       offset=base + s * stride + _LINE) for s in range(self.slots)]
        self.next_seq = 1  # the writer's next sequence number, or the one a reader expects
        if reader is not None:
            self.next_seq = self._acks[reader].value + 1

    @staticmethod
    def size(readers: int, slots: int, slot_words: int) -> int:
        return _LINE * (1 + readers) + slots * (_LINE + 8 * slot_words)

    @classmethod
    def create(cls, readers: int, slots: int = 8, slot_words: int = 1 << 15,
               directory: str = "/dev/shm") -> "ShmRing":
        path = os.path.join(directory, f"homelab-llm-plan-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        size = cls.size(readers, slots, slot_words)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        head = (ctypes.c_int64 * 4).from_buffer(mm, 0)
        head[:] = [os.getpid(), readers, slots, slot_words]
        del head
        return cls(path, mm, None)

    @classmethod
    def attach(cls, path: str, reader: int | None) -> "ShmRing":
        """Map an existing ring as reader `reader` (or, with None, as its one writer)."""
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(path, mm, reader)

    def unlink(self) -> None:
        """Remove the name (the writer does this once every reader has mapped the ring)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # -- writer -------------------------------------------------------------------------------
    def write(self, words: torch.Tensor, peers_alive: Callable[[], bool] | None = None,
              timeout: float | None = None) -> None:
        """Publish one message (a 1-D int64 tensor) to every reader."""
        n = words.numel()
        off = 0
        while True:
            seq = self.next_seq
            need = seq - self.slots  # every reader must have consumed this sequence number

            def room() -> bool:
                return all(a.value >= need for a in self._acks)

            if need > 0 and not room():
                _wait(room, peers_alive, timeout, "a tensor-parallel worker stopped reading")
            s = (seq - 1) % self.slots
            chunk = min(self.slot_words, n - off)
            if chunk:
                self._data[s][:chunk].copy_(words[off:off + chunk])
            self._len[s].value = n
            self._seq[s].value = seq  # publish last
            self.next_seq = seq + 1
            off += chunk
            if off >= n:
                return

    # -- reader -------------------------------------------------------------------------------
    def read(self, writer_alive: Callable[[], bool] | None = None,
             timeout: float | None = None) -> torch.Tensor:
        """The next message, as a new 1-D int64 tensor."""
        alive = writer_alive or (lambda: _alive(self.writer_pid))
        out: torch.Tensor | None = None
        off = 0
        while True:
            seq = self.next_seq
            s = (seq - 1) % self.slots
            slot_seq = self._seq[s]
            if slot_seq.value != seq:
                _wait(lambda: slot_seq.value == seq, alive, timeout, "rank 0 stopped")
            n = self._len[s].value
            if out is None:
                out = torch.empty(n, dtype=torch.int64)
            chunk = min(self.slot_words, n - off)
            if chunk:
                out[off:off + chunk].copy_(self._data[s][:chunk])
            self._acks[self.reader].value = seq
            self.next_seq = seq + 1
            off += chunk
            if off >= n:
                return out

    def close(self) -> None:
        self._acks = self._seq = self._len = []
        self._data = []
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass


def _wait(ready: Callable[[], bool], alive: Callable[[], bool] | None, timeout: float | None,
          what: str) -> None:
    start = last_check = time.monotonic()
    nap = 1e-5
    while not ready():
        now = time.monotonic()
        if now - last_check >= CHECK_S:
            last_check = now
            if alive is not None and not alive():
                raise ChannelClosed(f"{what}: the process on the other side is gone")
            if timeout is not None and now - start > timeout:
                raise ChannelClosed(f"{what}: nothing for {timeout:.0f} s")
        if now - start < SPIN_S:
            os.sched_yield()
        else:
            time.sleep(nap)
            nap = min(NAP_S, nap * 2)
