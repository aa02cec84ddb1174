"""Which all-reduce a rank uses: the one-shot kernel over peer-mapped buffers, or NCCL/RCCL.

Set up once per rank right after the process group exists (`setup_all_reduce`). Each rank
allocates one buffer with the runtime's own allocator (cudaMalloc / hipMalloc, so an IPC handle
maps exactly that buffer and no peer needs a context on our GPU), the ranks swap IPC handles over
the gloo group and map each other's buffers. Then a self-check (same result as NCCL, bit-identical
on every rank) and a latency probe per message size inside CUDA/HIP graphs (decode runs in graphs)
pick, per size, the faster path. Every decision is made from numbers all ranks share, so every
rank takes the same path for the same message (a rank on the other path would hang its peers).

NCCL/RCCL stays in charge when: several hosts, not every GPU pair has P2P, the self-check fails,
a message is over the buffer size, or it measured faster. `HOMELAB_ALLREDUCE` overrides:
auto (default) | custom (the kernel wherever it can run) | nccl | none (skip every all-reduce:
wrong results, benchmarks only, to time a step without communication).

Not done: a host-staged candidate for boards without P2P (consumer PCIe cards); they get NCCL/RCCL.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from homelab_llm.engine.parallel.state import set_all_reduce

log = logging.getLogger("homelab_llm.engine.parallel.comm")

ENV_MODE = "HOMELAB_ALLREDUCE"
MODES = ("auto", "custom", "nccl", "none")
MAX_BYTES = 2 << 20  # per data half: a batch-256 decode step of a 4096-wide bf16 model
NUM_PROGRAMS = 32  # fixed for a buffer's lifetime (see kernels/allreduce.py); all stay resident
# One tile = 16 bytes per thread (bf16) over 512 threads: an 8 KB decode message is one program,
# 1 MB is 4 tiles per program. Fits RDNA3 (wave32, 1024 threads per workgroup) as well.
BLOCK, NUM_WARPS = 4096, 16
PROBE_SIZES = (8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def read_mode() -> str:
    mode = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_MODE}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


@dataclass(frozen=True)
class PathTable:
    """Per message size: use the kernel? `limits` ascending; a message takes the row of the first
    limit >= its size; bigger than the last limit -> NCCL."""
    limits: tuple[int, ...] = ()
    use_custom: tuple[bool, ...] = ()

    def custom_for(self, nbytes: int) -> bool:
        for limit, use in zip(self.limits, self.use_custom):
            if nbytes <= limit:
                return use
        return False


def choose_paths(mode: str, usable: bool, sizes: tuple[int, ...],
                 custom_us: list[float] | None = None, nccl_us: list[float] | None = None) -> PathTable:
    """The decision, as a pure function: `usable` = one host, P2P everywhere, self-check passed;
    latencies are per size (the max over ranks), needed in auto mode only."""
    if not usable or mode in ("nccl", "none"):
        return PathTable()
    if mode == "custom":
        return PathTable(tuple(sizes), tuple(True for _ in sizes))
    assert custom_us is not None and nccl_us is not None
    return PathTable(tuple(sizes), tuple(c < n for c, n in zip(custom_us, nccl_us)))


class _Runtime:
    """The few CUDA/HIP runtime calls torch does not expose, through the runtime torch loaded."""

    class Handle(ctypes.Structure):
        _fields_ = [("reserved", ctypes.c_byte * 64)]  # cudaIpcMemHandle_t / hipIpcMemHandle_t

    def __init__(self, device_index: int) -> None:
        self.hip = torch.version.hip is not None
        self.prefix = "hip" if self.hip else "cuda"
        self.lib = ctypes.CDLL(_loaded_library("libamdhip64" if self.hip else "libcudart"))
        p = ctypes.c_void_p
        self._sig("SetDevice", [ctypes.c_int])
        self._sig("Malloc", [ctypes.POINTER(p), ctypes.c_size_t])
        self._sig("Free", [p])
        self._sig("Memset", [p, ctypes.c_int, ctypes.c_size_t])
        self._sig("DeviceSynchronize", [])
        self._sig("IpcGetMemHandle", [ctypes.POINTER(self.Handle), p])
        self._sig("IpcOpenMemHandle", [ctypes.POINTER(p), self.Handle, ctypes.c_uint])
        self._sig("IpcCloseMemHandle", [p])
        self._sig("GetErrorString", [ctypes.c_int], ctypes.c_char_p)
        if self.hip:
            self._sig("ExtMallocWithFlags", [ctypes.POINTER(p), ctypes.c_size_t, ctypes.c_uint])
        self.call("SetDevice", device_index)  # in case this is not torch's copy of the runtime

    def _sig(self, name: str, args: list, restype=ctypes.c_int) -> None:
        fn = getattr(self.lib, self.prefix + name)
        fn.argtypes, fn.restype = args, restype

    def call(self, name: str, *args) -> None:
        err = getattr(self.lib, self.prefix + name)(*args)
        if err:
            msg = getattr(self.lib, self.prefix + "GetErrorString")(err).decode()
            raise RuntimeError(f"{self.prefix}{name} failed: {msg} ({err})")

    def malloc_zeroed(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        if self.hip:  # uncached: peers see flags and data while our kernel still runs
            self.call("ExtMallocWithFlags", ctypes.byref(ptr), nbytes, 3)  # hipDeviceMallocUncached
        else:
            self.call("Malloc", ctypes.byref(ptr), nbytes)
        self.call("Memset", ptr, 0, nbytes)
        self.call("DeviceSynchronize")
        return int(ptr.value)

    def ipc_handle(self, ptr: int) -> bytes:
        h = self.Handle()
        self.call("IpcGetMemHandle", ctypes.byref(h), ctypes.c_void_p(ptr))
        return bytes(h.reserved)

    def ipc_open(self, handle: bytes) -> int:
        h = self.Handle()
        ctypes.memmove(h.reserved, handle, 64)
        ptr = ctypes.c_void_p()
        self.call("IpcOpenMemHandle", ctypes.byref(ptr), h, 1)  # LazyEnablePeerAccess
        return int(ptr.value)


def _loaded_library(stem: str) -> str:
    """The copy torch loaded (same runtime state), else whatever the loader finds."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith(stem + ".so"):
                return path
    return stem + ".so"


class PeerAllReduce:
    """One rank's mapped buffers and path table. `all_reduce(x)` sums in place."""

    def __init__(self, group: dist.ProcessGroup, mode: str = "auto", max_bytes: int = MAX_BYTES,
                 num_programs: int = NUM_PROGRAMS) -> None:
        from homelab_llm.engine.kernels.allreduce import signal_words

        self.group = group
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.mode = mode
        self.max_bytes = max_bytes
        self.num_programs = num_programs
        self.table = PathTable()
        self.reason = ""
        self._rt: _Runtime | None = None
        self._own: int | None = None
        self._peers: list[int] = []
        if not self._peer_mappable():
            return
        # Each step may fail on one rank only (no runtime library, IPC refused): every rank still
        # joins every collective, and all fall back together.
        handle = None
        try:
            self._rt = _Runtime(self.device.index)
            self._own = self._rt.malloc_zeroed(2 * max_bytes + 8 * signal_words(num_programs, self.world))
            handle = self._rt.ipc_handle(self._own)
        except (OSError, AttributeError, RuntimeError) as exc:
            log.warning("all-reduce buffer setup failed: %s", exc)
        handles = [None] * self.world
        dist.all_gather_object(handles, handle, group=group)
        opened = all(h is not None for h in handles)
        if opened:
            try:
                bases = [self._own if r == self.rank else self._rt.ipc_open(h)
                         for r, h in enumerate(handles)]
                self._peers = [b for r, b in enumerate(bases) if r != self.rank]
            except RuntimeError as exc:
                log.warning("opening a peer's all-reduce buffer failed: %s", exc)
                opened = False
        if self._agree(float(opened), dist.ReduceOp.MIN) < 1.0:
            self.reason = "peer buffers could not be mapped (IPC)"
            self.close()
            return
        self.data_ptrs = torch.tensor(bases, dtype=torch.int64, device=self.device)
        self.signal_ptrs = torch.tensor([b + 2 * max_bytes for b in bases], dtype=torch.int64,
                                        device=self.device)

    def _peer_mappable(self) -> bool:
        """Same answer on every rank: one host, every GPU pair has P2P, a mode that wants it."""
        facts = (socket.gethostname(), torch.cuda.current_device())
        everyone = [None] * self.world
        dist.all_gather_object(everyone, facts, group=self.group)
        if self.mode in ("nccl", "none"):
            self.reason = f"{ENV_MODE}={self.mode}"
        elif self.world == 1:
            self.reason = "one rank"
        elif len({host for host, _ in everyone}) > 1:
            self.reason = "ranks on several hosts"
        else:
            devices = [d for _, d in everyone]
            missing = [(a, b) for a in devices for b in devices
                       if a != b and not torch.cuda.can_device_access_peer(a, b)]
            if len(set(devices)) != len(devices):
                self.reason = "two ranks share a GPU"
            elif missing:
                self.reason = f"no P2P between GPUs {missing[0][0]} and {missing[0][1]}"
        return not self.reason

    # The hot path: state.all_reduce asks `handles` first, so NCCL messages pay one check.
    def handles(self, x: torch.Tensor) -> bool:
        return (self.table.custom_for(x.numel() * x.element_size()) and x.dtype in DTYPES
                and x.is_contiguous() and x.device == self.device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        from homelab_llm.engine.kernels.allreduce import one_shot_all_reduce

        return one_shot_all_reduce(x, x, self.data_ptrs, self.signal_ptrs,
                                   self.max_bytes // x.element_size(), self.rank, self.world,
                                   self.num_programs, BLOCK, NUM_WARPS)

    def decide(self) -> PathTable:
        """Self-check, then (auto) time both paths per size; sets and returns the path table."""
        if self._own is None:
            return self.table
        ok = self._self_check()
        custom_us = nccl_us = None
        if ok and self.mode == "auto":
            custom_us, nccl_us = self.measure(PROBE_SIZES)
        if not ok:
            self.reason = "self-check against NCCL failed"
        self.table = choose_paths(self.mode, ok, PROBE_SIZES, custom_us, nccl_us)
        torch.cuda.empty_cache()  # the probe graphs' memory goes back before KV sizing
        if ok:
            rows = ", ".join(
                f"{s // 1024}KB {'custom' if u else 'nccl'}"
                + (f" ({custom_us[i]:.1f} vs {nccl_us[i]:.1f} us)" if custom_us else "")
                for i, (s, u) in enumerate(zip(self.table.limits, self.table.use_custom)))
            log.info("all-reduce paths (rank %d): %s", self.rank, rows)
        return self.table

    def _agree(self, value: float, op=dist.ReduceOp.MAX) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.group)
        return float(t)

    def _self_check(self) -> bool:
        """Against NCCL on random data, several sizes (both buffer halves), and bit-identical on
        every rank. Any exception counts as a failure on every rank."""
        ok = 1.0
        try:
            gen = torch.Generator(device=self.device).manual_seed(1234 + self.rank)
            for n in (1, 4097, 65536 + 3, self.max_bytes // 2):
                x = torch.randn(n, generator=gen, device=self.device, dtype=torch.bfloat16)
                want = x.clone()
                dist.all_reduce(want)
                got = self.all_reduce(x.clone())
                again = self.all_reduce(x.clone())
                scale = want.float().abs().max().clamp_min(1.0)
                err = float((got.float() - want.float()).abs().max() / scale)
                bits = got.view(torch.int16).long()  # an exact integer digest of the bits
                digest = float((bits * (torch.arange(n, device=self.device) % 7 + 1)).sum())
                same = self._agree(digest) == -self._agree(-digest)
                if not (err <= 2.0 ** -7 * self.world and torch.equal(got, again) and same):
                    log.warning("all-reduce self-check failed at %d elements: rel err %.3g, "
                                "repeat equal %s, ranks identical %s", n, err,
                                torch.equal(got, again), same)
                    ok = 0.0
                    break
        except Exception as exc:  # the kernel failed to build or run here: fall back
            log.warning("all-reduce self-check raised: %s", exc)
            ok = 0.0
        return self._agree(ok, dist.ReduceOp.MIN) > 0.0

    def measure(self, sizes: tuple[int, ...], calls: int = 16, replays: int = 3
                ) -> tuple[list[float], list[float]]:
        """Microseconds per call for each size, the kernel and NCCL, each timed as `calls`
        back-to-back calls in one CUDA/HIP graph; the max over ranks."""
        custom, nccl = [], []
        for size in sizes:
            x = torch.zeros(size // 2, device=self.device, dtype=torch.bfloat16)
            custom.append(self._agree(_graph_us(lambda: self.all_reduce(x), calls, replays)))
            nccl.append(self._agree(_graph_us(lambda: dist.all_reduce(x), calls, replays)))
        return custom, nccl

    # Leaving, in the order shutdown needs (shutdown.leave): every rank's GPU idle, then
    # each rank unmaps its peers' buffers, a barrier, then each frees its own. An owner that frees
    # first would pull memory from under a peer's mapping; one that never frees leaks it into the
    # next engine of this process. Each step never raises: a peer may be gone already.
    def release_peers(self) -> None:
        """Unmap the peers' buffers mapped here (this rank's GPU work is done)."""
        self.table = PathTable()  # nothing takes the kernel path from here on
        if self._rt is None:
            return
        peers, self._peers = self._peers, []
        try:
            torch.cuda.synchronize(self.device)
            for ptr in peers:
                self._rt.call("IpcCloseMemHandle", ctypes.c_void_p(ptr))
        except RuntimeError as exc:
            log.warning("unmapping peer all-reduce buffers: %s", exc)

    def release_own(self) -> None:
        """Free this rank's buffer: only once every peer unmapped it (or is gone)."""
        if self._rt is None:
            return
        try:
            if self._own is not None:
                self._rt.call("Free", ctypes.c_void_p(self._own))
        except RuntimeError as exc:
            log.warning("freeing the all-reduce buffer: %s", exc)
        self._rt, self._own = None, None

    def close(self) -> None:
        """Both steps at once: setup fell back to NCCL, or the peers are gone already."""
        self.release_peers()
        self.release_own()

    def abandon(self) -> None:
        """Forget the buffers without a GPU call: a peer died mid-step, so a kernel here may wait
        on its flags forever and any synchronizing call (free, unmap) would wait with it. The
        memory goes back when the process exits."""
        self._rt, self._own, self._peers, self.table = None, None, [], PathTable()


def _graph_us(fn, calls: int, replays: int) -> float:
    fn()  # eager first: compiles, and NCCL sets up its communicator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()  # the first replay also absorbs the ranks' skew
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (replays * calls) * 1e6


def setup_all_reduce(group: dist.ProcessGroup) -> PeerAllReduce | None:
    """After init_process_group on a GPU rank: build, decide, and install into parallel/state.py.
    Every rank calls it (it runs collectives on `group`, a gloo group)."""
    mode = read_mode()
    comm = PeerAllReduce(group, mode)
    comm.decide()
    if comm.reason:
        log.info("all-reduce: NCCL/RCCL only (%s)", comm.reason)
    set_all_reduce(comm if any(comm.table.use_custom) else None, skip=mode == "none")
    if not any(comm.table.use_custom):
        comm.close()
    return comm
