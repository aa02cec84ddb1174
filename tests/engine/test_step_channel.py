"""The shared-memory plan ring: messages arrive whole and in order (one slot, many slots, wrapping
around), a full ring waits for readers, and each side notices when the other died."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch

from homelab_llm.engine.parallel import ring as step_channel
from homelab_llm.engine.parallel.ring import ChannelClosed, ShmRing


def _ring(tmp_path: Path, readers: int = 1, slots: int = 4, slot_words: int = 16):
    w = ShmRing.create(readers, slots, slot_words, directory=str(tmp_path))
    rs = [ShmRing.attach(w.path, r) for r in range(readers)]
    return w, rs


def test_messages_arrive_in_order_across_slot_sizes(tmp_path: Path) -> None:
    w, (r,) = _ring(tmp_path, slots=4, slot_words=16)
    g = torch.Generator().manual_seed(0)
    # Sizes below, at and above one slot (16 words) and above the whole ring (64 words).
    for n in (0, 1, 10, 16, 17, 40, 64, 100, 3):
        msg = torch.randint(-2**62, 2**62, (n,), generator=g)
        if n <= 64:
            w.write(msg)
            got = r.read()
        else:  # bigger than the ring: the reader must drain while the writer writes
            import threading

            out: list[torch.Tensor] = []
            t = threading.Thread(target=lambda: out.append(r.read()))
            t.start()
            w.write(msg, timeout=10)
            t.join(10)
            got = out[0]
        assert torch.equal(got, msg)
    w.close(); r.close(); w.unlink()


def test_every_reader_gets_every_message(tmp_path: Path) -> None:
    w, rs = _ring(tmp_path, readers=3, slots=2, slot_words=8)
    for i in range(7):  # more messages than slots: wraps around, readers keep up in turn
        w.write(torch.arange(i, i + 5))
        for r in rs:
            assert r.read().tolist() == list(range(i, i + 5))


def test_a_full_ring_waits_then_notices_a_dead_reader(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(step_channel, "CHECK_S", 0.01)
    monkeypatch.setattr(step_channel, "SPIN_S", 0.001)
    w, (r,) = _ring(tmp_path, slots=2, slot_words=4)
    w.write(torch.ones(3, dtype=torch.long))
    w.write(torch.ones(3, dtype=torch.long))
    with pytest.raises(ChannelClosed, match="stopped reading"):
        w.write(torch.ones(3, dtype=torch.long), peers_alive=lambda: False)
    with pytest.raises(ChannelClosed, match="nothing for"):
        w.write(torch.ones(3, dtype=torch.long), timeout=0.05)
    r.read()  # one slot freed: the write goes through
    w.write(torch.full((3,), 7, dtype=torch.long), timeout=1)
    assert r.read().tolist() == [1, 1, 1]
    assert r.read().tolist() == [7, 7, 7]


def test_a_waiting_reader_notices_the_writer_died(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(step_channel, "CHECK_S", 0.01)
    monkeypatch.setattr(step_channel, "SPIN_S", 0.001)
    w, (r,) = _ring(tmp_path)
    start = time.monotonic()
    with pytest.raises(ChannelClosed, match="rank 0 stopped"):
        r.read(writer_alive=lambda: time.monotonic() - start < 0.05)


def _writer_then_die(path_q, directory: str) -> None:
    w = ShmRing.create(1, 2, 8, directory=directory)
    path_q.put(w.path)
    w.write(torch.tensor([1, 2, 3]))
    time.sleep(0.3)
    os._exit(0)  # dies without another message


def test_a_reader_notices_a_dead_writer_process(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(step_channel, "CHECK_S", 0.02)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_writer_then_die, args=(q, str(tmp_path)))
    p.start()
    path = q.get(timeout=60)
    r = ShmRing.attach(path, 0)
    os.unlink(path)  # the mapping outlives the name
    assert r.read().tolist() == [1, 2, 3]
    start = time.monotonic()
    with pytest.raises(ChannelClosed):
        r.read()  # default liveness check: the writer's pid, stored in the ring
    assert time.monotonic() - start < 10
    p.join()
    assert not any(tmp_path.iterdir())
